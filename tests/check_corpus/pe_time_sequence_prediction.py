"""Modelled on pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8 time_sequence_prediction/train.py and
generate_sine_wave.py: a Sequence model of two stacked LSTMCells and a linear read-out, run step by step over
shifted sine waves in float64, MSELoss, LBFGS(lr=0.8) with a closure that zeroes, evaluates and backpropagates,
then a no-grad prediction of the future after each step. Data: the same kind of sine waves, generated here,
shorter and fewer. Tiny sizes.

--bug no-zero-grad: the closure forgets optimizer.zero_grad(), so each evaluation adds to the last one's
gradients (LBFGS evaluates the closure many times per step).
--lr 80: the learning rate 100x the default."""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from _corpus import Recorder

H = 16


class Sequence(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm1 = nn.LSTMCell(1, H)
        self.lstm2 = nn.LSTMCell(H, H)
        self.linear = nn.Linear(H, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), H, dtype=torch.double)
        c_t = torch.zeros(input.size(0), H, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), H, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), H, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for _ in range(future):
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        return torch.cat(outputs, dim=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=0.8)
    parser.add_argument("--bug", choices=["none", "no-zero-grad"], default="none")
    opt = parser.parse_args()
    np.random.seed(0)
    torch.manual_seed(0)
    # the sine waves: T=20, each shifted by a random offset
    rng = np.random.RandomState(2)
    T, L, N = 20, 40, 10
    x = np.empty((N, L), "int64")
    x[:] = np.array(range(L)) + rng.randint(-4 * T, 4 * T, N).reshape(N, 1)
    data = np.sin(x / 1.0 / T).astype("float64")
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    seq = Sequence()
    seq.double()
    criterion = nn.MSELoss()
    optimizer = optim.LBFGS(seq.parameters(), lr=opt.lr, max_iter=5)
    rec = Recorder()
    for i in range(opt.steps):
        print("STEP: ", i)
        evals = []

        def closure():
            if opt.bug != "no-zero-grad":
                optimizer.zero_grad()
            out = seq(input)
            loss = criterion(out, target)
            print("loss:", loss.item())
            loss.backward()
            if not evals:  # the step's first evaluation: what check reports for the step
                rec.loss(loss)
                rec.row(seq.parameters(), model=seq, lr=opt.lr)
            evals.append(loss.item())
            return loss

        optimizer.step(closure)
        rec.note(evals=len(evals))
        with torch.no_grad():
            future = 20
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print("test loss:", loss.item())
