"""A regression whose encoder, the model's entry layer, is dead from the first step: an initialisation helper
meant for gate biases set its bias to -10, so its ReLU is off for every input and no gradient passes back
through it. The encoder's first Linear (weight and bias) and the next Linear's weight (its input is all zero)
get an exactly zero gradient at every step; the rest learns the targets' mean only. The targets are on a scale
of ~40 (prices), so the gradient norm is above 100 at the first steps.
Expected: never_learns first, a warning naming encoder.0.weight, encoder.0.bias and encoder.2.weight; the norm
above 100 is the guide's question (a notice), not the first finding; exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                           torch.nn.ReLU())
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 1)

    def forward(self, x):
        return self.head(self.body(self.encoder(x)))


def init_gate_bias(module, value=-10.0):  # meant for a gate's bias; applied to the encoder by mistake
    torch.nn.init.constant_(module.bias, value)


model = Net()
init_gate_bias(model.encoder[0])
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
w = torch.randn(16, 1)
truth = Truth()
for step in range(1, 41):
    x = torch.randn(64, 16)
    y = 40.0 + 10.0 * (x @ w)
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(),
              zero=[n for n, p in model.named_parameters() if p.grad is None or not bool(p.grad.any())])
    optimizer.step()
print("done")
