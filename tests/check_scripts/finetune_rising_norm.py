"""A fine-tune whose new head starts at zero: the gradient norm starts on a low plateau and rises as the head
grows, while the loss falls and the script clips at max_norm=1.0 every step. Expected: no `increasing`
warning (a rising norm that precedes divergence is not what this is), exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
body = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.GELU(), torch.nn.Linear(256, 64), torch.nn.GELU())
head = torch.nn.Linear(64, 4)
torch.nn.init.zeros_(head.weight)
torch.nn.init.zeros_(head.bias)
model = torch.nn.Sequential(body, head)
opt = torch.optim.Adam(model.parameters(), lr=1.5e-4)
w = torch.randn(16, 4)
truth = Truth()
for step in range(1, 141):
    x = torch.randn(64, 16)
    y = (x @ w).argmax(1)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    truth.add(step=step, norm=grad_norm(model.parameters()), loss=loss.item())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
print("done")
