"""An RNN whose recurrent weights amplify the state: the gradient norm explodes and then turns Inf/NaN.
Expected: critical (exploding / NaN), layer rnn named, red flag no_clipping."""
import torch

torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.RNN(8, 32, nonlinearity="relu", batch_first=True)
        self.head = torch.nn.Linear(32, 1)
        with torch.no_grad():
            self.rnn.weight_hh_l0.copy_(torch.eye(32) + 0.02 * torch.randn(32, 32))

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=3e-3)
for step in range(40):
    x = torch.randn(16, 30, 8)
    y = torch.randn(16, 1)
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
