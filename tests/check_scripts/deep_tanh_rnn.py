"""A sequence regressor on a deep stacked nn.RNN (tanh, 8 layers) initialised with small weights: each layer
passes back a fraction of the gradient it gets, so the first layer's weights receive three orders of magnitude
less gradient than the last layer's. All eight layers are one module (rnn.weight_ih_l0 ... rnn.weight_ih_l7).
Expected: depth_vanishing naming the first layers of the stack (rnn.l0, ...), a warning; advice that fits a
recurrent model (no ReLU advice); exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self, layers=8):
        super().__init__()
        self.rnn = torch.nn.RNN(8, 32, num_layers=layers, batch_first=True)
        self.head = torch.nn.Linear(32, 1)
        with torch.no_grad():
            for name, p in self.rnn.named_parameters():
                if name.startswith("weight"):
                    p.mul_(0.25)  # a small initialisation: the stack contracts the gradient layer by layer

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
truth = Truth()
for step in range(1, 31):
    x = torch.randn(32, 12, 8)
    y = x[:, -1, :1]
    optimizer.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    per_layer = {k: grad_norm([p for n, p in model.rnn.named_parameters() if n.endswith(f"_l{k}")])
                 for k in range(8)}
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(), first=per_layer[0],
              last=per_layer[7], head=grad_norm(model.head.parameters()))
    optimizer.step()
print("done")
