import time, torch, fastgrad, os
torch.set_num_threads(1)
ps = [torch.nn.Parameter(torch.zeros(1)) for _ in range(148)]
opt = torch.optim.SGD(ps, lr=0.0)
g = fastgrad.StepGuard(opt, 1e9)
for p in ps: p.grad = torch.ones(1)
fold, read = [], []
for r in range(30):
    for _ in range(255):
        g.clip_(); opt.step()
    t = time.thread_time(); g.clip_(); opt.step(); fold_t = time.thread_time() - t  # the 256th: clip_ and step with the fold
    t = time.thread_time(); g.state(); read.append(time.thread_time() - t)
    fold.append(fold_t)
fold.sort(); read.sort()
print(f"# {fastgrad.__file__}, load {os.getloadavg()[0]:.2f}; microseconds of thread time, 30 rounds")
print(f"step with the fold: min {fold[0]*1e6:.1f} median {fold[15]*1e6:.1f}")
print(f"state() (one read): min {read[0]*1e6:.1f} median {read[15]*1e6:.1f}")
