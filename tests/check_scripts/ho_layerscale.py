"""A deep residual MLP with LayerScale (each block's branch multiplied by a learned gamma initialised to 1e-5,
as in CaiT/ConvNeXt) and a learned temperature inside the head: the branch layers' gradients are ~1e-5 of
the head's by construction, at every depth (the first block's as the last's). The loss falls. Expected: no depth_vanishing (nothing
vanishes with depth), no warning, exit 0."""
import torch
from _truth import Truth, grad_norm


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 2 * d)
        self.fc2 = torch.nn.Linear(2 * d, d)
        self.gamma = torch.nn.Parameter(torch.full((d,), 1e-5))

    def forward(self, x):
        return x + self.gamma * self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Head(torch.nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.proj = torch.nn.Linear(d, k)
        self.temperature = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, x):
        return self.proj(x) / self.temperature


class Net(torch.nn.Module):
    def __init__(self, d=32, depth=12, k=5):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(d) for _ in range(depth)])
        self.head = Head(d, k)

    def forward(self, x):
        return self.head(self.blocks(x))


torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(256, 32)
y = (x[:, :5].argmax(1))
truth = Truth()
for step in range(1, 41):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item(),
              first_branch=grad_norm(model.blocks[0].fc1.parameters()), head=grad_norm(model.head.proj.parameters()))
    opt.step()
print("done")
