"""float16 autocast with a GradScaler started at a huge scale (2**40): the first steps' scaled float16
gradients overflow, the scaler skips them and halves its scale until it fits; after that the run is healthy.
The true (unscaled) gradient norm is ~1 throughout. Expected: amp_skipped (a notice), never exploding, exit 0."""
import torch
from _truth import Truth, grad_norm

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
x = torch.randn(256, 32)
y = torch.randint(0, 10, (256,))
truth = Truth()
for step in range(1, 61):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    truth.add(step=step, norm=grad_norm(model.parameters()) if finite else float("inf"), finite=finite,
              loss=loss.item(), scale=scaler.get_scale())
    scaler.step(opt)
    scaler.update()
print("done")
