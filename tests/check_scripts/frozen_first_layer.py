"""A small classifier as a new user writes one: its first layer is a frozen feature extractor (requires_grad
False, left out of the optimizer), the rest is trained with SGD. At the default learning rate it learns; at
--lr 8 each update moves the trained weights by several times their own size and the loss climbs.
Expected (--lr 8): the learning rate blamed, the update/weight ratio row not healthy, the frozen first layer
named in the summary (not a finding); exit 1.
--all-params: the optimizer is handed the frozen layer too (as a stray requires_grad_(False) looks): a notice
naming it. --all-params --unfreeze 20: the layer trains from step 20 on, so nothing is frozen for good."""
import argparse

import torch
from _truth import Truth, flat_params, grad_norm, update_ratio

p = argparse.ArgumentParser()
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--all-params", action="store_true", help="hand the optimizer every parameter, the frozen ones too")
p.add_argument("--unfreeze", type=int, default=0, help="make the first layer trainable again at this step")
a = p.parse_args()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                          torch.nn.Linear(64, 3))
for prm in net[0].parameters():
    prm.requires_grad_(False)  # a pretrained feature extractor, kept as it is
trainable = [prm for prm in net.parameters() if prm.requires_grad]
sgd = torch.optim.SGD(list(net.parameters()) if a.all_params else trainable, lr=a.lr)
features = torch.randn(512, 20)
labels = (features[:, :3] + 0.3 * torch.randn(512, 3)).argmax(1)
truth = Truth()
for step in range(1, 41):
    if step == a.unfreeze:  # a fine-tune that trains its feature extractor from here on
        for prm in net[0].parameters():
            prm.requires_grad_(True)
    idx = torch.randint(0, 512, (64,))
    sgd.zero_grad()
    out = torch.nn.functional.cross_entropy(net(features[idx]), labels[idx])
    out.backward()
    before = flat_params(trainable)
    norm = grad_norm(trainable)
    sgd.step()
    truth.add(step=step, norm=norm, loss=out.item(), update=update_ratio(before, flat_params(trainable)),
              no_grad=[n for n, prm in net.named_parameters() if prm.grad is None])
print("done")
