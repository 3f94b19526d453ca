"""A training loop inside a harness that catches every exception and exits 1, as pytest does with a test that
raised: check's --steps stop is caught too, and the script's exit status is the harness's, not a crash."""
import sys

import torch

torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    for _ in range(50):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
except BaseException as e:  # noqa: BLE001 - the harness's way
    print(f"the run raised {type(e).__name__}")
    sys.exit(1)
