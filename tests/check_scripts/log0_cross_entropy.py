"""A hand-written cross-entropy (softmax, then log of the true class's probability) and a learning rate high
enough for the logits to grow until a probability underflows to exactly 0: log(0) = -inf in the loss, NaN
gradients, NaN weights, and only then NaN outputs of the first Linear layer. Expected: the NaN is traced to
the loss (born outside every module, at the step the truth records), not blamed on the Linear layer, and
after the updates of lr 20 that rewrote the weights, which come first as its cause."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(10, 64), torch.nn.ReLU(), torch.nn.Linear(64, 5))
opt = torch.optim.SGD(model.parameters(), lr=20.0)
truth = Truth()
for step in range(1, 31):
    x = torch.randn(64, 10)
    y = torch.randint(0, 5, (64,))
    probs = torch.softmax(model(x), dim=1)
    loss = -torch.log(probs[torch.arange(64), y]).mean()  # no eps, no log_softmax
    opt.zero_grad()
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(),
              loss_finite=bool(torch.isfinite(loss)))
    opt.step()
print("done")
