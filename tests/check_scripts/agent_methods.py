"""An agent in the style of single-file RL code: the module holds its own optimizer and calls its layers from
methods (``pi``, ``v``), never through ``forward``, so each layer is the first module a forward reaches."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class ActorCritic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 32)
        self.fc_pi = nn.Linear(32, 2)
        self.fc_v = nn.Linear(32, 1)
        self.optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)

    def pi(self, x):
        return F.softmax(self.fc_pi(F.relu(self.fc1(x))), dim=-1)

    def v(self, x):
        return self.fc_v(F.relu(self.fc1(x)))

    def train_net(self, x, target):
        loss = -self.pi(x)[:, 0].log().mean() + F.mse_loss(self.v(x), target)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()


def main():
    torch.manual_seed(0)
    model = ActorCritic()
    for _ in range(40):
        x = torch.randn(16, 4)
        model.train_net(x, x.sum(1, keepdim=True))


main()
