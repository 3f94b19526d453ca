"""An AMP loop (CPU GradScaler, bf16 autocast) that clips the still-scaled gradients. Expected: critical
clip_scaled, exit 1."""
import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu")
for step in range(20):
    x = torch.randn(32, 16)
    y = torch.randint(0, 4, (32,))
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # BUG: the gradients are still scaled
    scaler.step(opt)
    scaler.update()
