"""The script generator of the judgement fuzz (``tests/judgement_fuzz.py``): a seed picks a family, a loop and at
most one defect, and :func:`script_of` writes a complete training script from those parts: a tiny model,
synthetic data made in the script from the seed, a few dozen steps, plain torch only.

The split is fixed here, before any check result is read: the last three families of ``FAMILIES`` with the
seeds from ``HELD_OUT_SEED0`` on are the held-out part, reported and never tuned against; the other families
with the seeds below it are the development part. A seed therefore names its part, and replays its script."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

FAMILIES = ("mlp", "cnn_bn", "rnn", "tf_preln", "tf_postln", "vae", "gan", "wgan", "policy_gradient",
            "actor_critic", "diffusion", "embedding_lm", "custom_opt")
HELD_OUT_FAMILIES = FAMILIES[-3:]
DEV_FAMILIES = FAMILIES[:-3]
HELD_OUT_SEED0 = 100_000

# Families whose loop is written with the family (several networks, an objective that is not a supervised
# loss); the others share the supervised loop below.
OWN_LOOP = {"gan", "wgan", "policy_gradient", "actor_critic"}
CLASSIFIERS = {"mlp", "cnn_bn", "rnn", "tf_preln", "tf_postln", "embedding_lm", "custom_opt"}
# the first Linear of these families is followed by a ReLU (a bias of -10 kills the layer)
RELU_FIRST = {"mlp": "model.body[0]", "custom_opt": "model.body[0]", "diffusion": "model.body[0]",
              "vae": "model.enc[0]"}

DEFECTS = ("lr_high", "lr_low", "sched_collapse", "sched_negative", "no_zero_grad", "zero_grad_every_k",
           "loss_not_divided", "clip_before_backward", "clip_before_unscale", "detach_subnet", "frozen_body",
           "dead_relu_init", "zero_init", "sign_flip", "softmax_ce", "nan_batch", "bn_nan_batch", "log_zero",
           "exploding_init", "random_labels", "weight_decay_drag", "unused_param", "update_rewrite")

BASE_LR = {"sgd": 0.05, "adam": 3e-3, "adamw": 3e-3, "rmsprop": 1e-3, "lbfgs": 0.5, "manual": 0.2,
           "custom": 0.2, "lion": 1e-3, "heavy_ball": 0.05}
# The hand-written updates of the development part (the held-out family `custom_opt` has its own, never these):
# a Lion-style optimizer class, and a momentum loop with no optimizer object. Drawn from a generator of their
# own (``_hand_written``), so the scripts of the other development seeds are what they were before them.
DEV_HAND_WRITTEN = ("lion", "heavy_ball")
# the loops that take no accumulation, GradScaler or weight decay defect
SIMPLE = ("lbfgs", "manual", "custom") + DEV_HAND_WRITTEN
STEPS = 40


@dataclass(frozen=True)
class Spec:
    seed: int
    family: str
    defect: str | None
    opt: str
    lr: float
    accum: int = 1
    scaler: bool = False
    sched: str = "none"          # none | warmup | cosine | step | lambda
    sched_per: str = "batch"     # batch | epoch (an epoch is EPOCH steps)
    clip: float | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def part(self) -> str:
        return "held_out" if self.seed >= HELD_OUT_SEED0 else "dev"

    @property
    def name(self) -> str:
        return f"s{self.seed}_{self.family}_{self.defect or 'healthy'}"


def families_of(seed: int) -> tuple[str, ...]:
    return HELD_OUT_FAMILIES if seed >= HELD_OUT_SEED0 else DEV_FAMILIES


def applicable(family: str, defect: str, opt: str, accum: int, scaler: bool) -> bool:
    """Whether ``defect`` can be written into a script of ``family`` with this loop."""
    sup = family not in OWN_LOOP
    if opt == "lbfgs" and defect not in {None, "nan_batch", "unused_param", "detach_subnet", "dead_relu_init",
                                         "random_labels", "softmax_ce", "log_zero", "zero_init", "lr_low"}:
        return False
    if opt in ("manual", "custom") + DEV_HAND_WRITTEN and defect in {
            "clip_before_unscale", "weight_decay_drag", "bn_nan_batch", "sched_collapse", "sched_negative"}:
        return False
    own = {"gan": {"lr_high", "no_zero_grad", "nan_batch", "unused_param", "detach_subnet", "sched_collapse"},
           "wgan": {"lr_high", "no_zero_grad", "nan_batch", "unused_param", "sched_collapse", "sched_negative"},
           "policy_gradient": {"lr_high", "lr_low", "no_zero_grad", "nan_batch", "unused_param", "sched_negative"},
           "actor_critic": {"lr_high", "lr_low", "no_zero_grad", "nan_batch", "unused_param", "sched_collapse"}}
    if not sup:
        return defect in own[family]
    need = {
        "zero_grad_every_k": accum >= 2, "loss_not_divided": accum >= 2 and opt in ("sgd", "manual", "custom"),
        "clip_before_unscale": scaler, "bn_nan_batch": family == "cnn_bn" and scaler,
        "detach_subnet": family != "vae", "dead_relu_init": family in RELU_FIRST,
        "zero_init": family in ("mlp", "custom_opt", "diffusion"), "softmax_ce": family in CLASSIFIERS,
        "random_labels": family in CLASSIFIERS, "log_zero": family != "vae",
        "nan_batch": family != "embedding_lm", "exploding_init": family in ("mlp", "custom_opt"),
        "weight_decay_drag": opt in ("adamw", "sgd"), "update_rewrite": opt == "sgd",
        "lr_high": opt != "manual", "no_zero_grad": opt != "lbfgs",
    }
    return need.get(defect, True)


def spec_of(seed: int, defect: str | None = "any") -> Spec:
    """The script of ``seed``: its family (from its part), loop and defect (``defect="any"``: drawn; a name or
    None forces it, for the self-tests and the healthy twin)."""
    rng = random.Random(seed)
    fams = families_of(seed)
    drawn = defect == "any"
    for _ in range(20):
        if drawn:
            defect = None if rng.random() < 0.25 else rng.choice(DEFECTS)
        for _ in range(100):   # a family and a loop the defect can be written into
            s = _draw(rng, seed, fams, defect)
            if s is not None:
                return s
        if not drawn:
            break
    raise ValueError(f"defect {defect!r} applies to no script of seed {seed}'s families")


def _draw(rng: random.Random, seed: int, fams, defect) -> Spec | None:
    family = fams[rng.randrange(len(fams))]
    if family in OWN_LOOP:
        opt = {"gan": "adam", "wgan": rng.choice(["rmsprop", "adam"]), "policy_gradient": rng.choice(["adam", "sgd"]),
               "actor_critic": "adam"}[family]
        accum, scaler, sched, per = 1, False, rng.choice(["none", "none", "cosine", "lambda"]), "batch"
        clip = rng.choice([None, 1.0]) if family in ("policy_gradient", "actor_critic") else None
    else:
        opts = ["custom", "custom", "manual"] if family == "custom_opt" else \
            ["sgd", "adam", "adamw", "rmsprop", "sgd", "adam", "adamw", "lbfgs"]
        opt = rng.choice(opts)
        simple = opt in SIMPLE
        accum = 1 if simple else rng.choice([1, 1, 2, 4])
        scaler = False if simple else rng.random() < 0.3
        sched = "none" if opt in ("lbfgs", "manual") else rng.choice(["none", "warmup", "cosine", "step", "lambda"])
        per = rng.choice(["batch", "epoch"])
        clip = None if opt == "lbfgs" else rng.choice([None, 1.0])
    extra = {"rnn_cell": rng.choice(["RNN", "LSTM", "GRU"]), "layers": rng.choice([1, 2, 3, 6, 12, 24]),
             "tf_layers": rng.choice([1, 2, 3]), "gp": rng.random() < 0.5, "sparse": rng.random() < 0.5,
             "width": rng.choice([16, 32]), "nan_step": rng.randrange(8, 30), "k": rng.choice([2, 3, 4]),
             "collapse": rng.choice(["lambda", "step"]), "body_act": rng.choice(["ReLU", "GELU"]),
             "custom_kind": rng.choice(["schedule_free", "sign_sgd"])}
    if extra["rnn_cell"] == "RNN":
        extra["layers"] = min(extra["layers"], 3)
    lr = BASE_LR[opt]
    if defect in ("clip_before_unscale", "bn_nan_batch") and opt not in SIMPLE:
        scaler = True
    if defect in ("zero_grad_every_k", "loss_not_divided") and accum < 2 and opt not in SIMPLE:
        accum = 2
    if defect == "clip_before_backward":
        clip = 0.05   # a bound the gradients exceed, so a clip in place would act
    if defect == "clip_before_unscale":
        clip = 0.5
    if family == "embedding_lm" and extra["sparse"]:
        clip = None   # torch's clip has no sparse gradients
        if defect in ("clip_before_backward", "clip_before_unscale"):
            return None
    if defect in ("sched_collapse", "sched_negative"):
        sched, per = "none", "batch"
    if defect == "exploding_init":
        extra["body_act"] = "Tanh"
        extra["deep"] = 8
    hand = _hand_written(seed, family, opt)
    if hand is not None and (defect is None or applicable(family, defect, hand, 1, False)):
        opt, lr, accum, scaler = hand, BASE_LR[hand], 1, False
        sched = "none" if hand == "heavy_ball" else sched
        if defect in ("clip_before_backward", "clip_before_unscale"):
            clip = 0.05
    if defect is not None and not applicable(family, defect, opt, accum, scaler):
        return None
    return Spec(seed, family, defect, opt, lr, accum, scaler, sched, per, clip, extra)


def _hand_written(seed: int, family: str, opt: str) -> str | None:
    """A development seed's hand-written update in place of its drawn optimizer (one seed in five of the
    supervised families; LBFGS scripts kept), from a generator of its own."""
    if family not in DEV_FAMILIES or family in OWN_LOOP or opt == "lbfgs":
        return None
    rng = random.Random(seed * 7907 + 11)
    return rng.choice(DEV_HAND_WRITTEN) if rng.random() < 0.2 else None


def twin(spec: Spec) -> Spec:
    """The healthy twin: the same script with the defect left out (its structural choices kept)."""
    return replace(spec, defect=None)


# ----------------------------------------------------------------------------------------------------- the parts
HEAD = '''"""Generated by tests/judgement_fuzz_gen.py: seed {seed}, family {family}, defect {defect}."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = {seed}
STEPS = {steps}
torch.manual_seed(SEED)
gen = torch.Generator().manual_seed(SEED + 1)
'''


def _lr_high(s: Spec) -> float:
    return {"sgd": 40.0, "adam": 1.0, "adamw": 1.0, "rmsprop": 1.0, "custom": 50.0}.get(s.opt, s.lr * 300)


def lr_of(s: Spec) -> float:
    if s.defect == "lr_high":
        return _lr_high(s)
    if s.defect == "lr_low":
        return s.lr * 1e-6
    if s.defect == "update_rewrite":
        return 30.0
    return s.lr


def _model(s: Spec) -> str:
    """``class Net`` and ``get_batch(step) -> (x, y)`` of a supervised family."""
    f, e = s.family, s.extra
    det = ".detach()" if s.defect == "detach_subnet" else ""
    w = e["width"]
    act = f"nn.{e['body_act']}()"
    if f in ("mlp", "custom_opt"):
        depth = e.get("deep", 2)
        hidden = "".join(f"nn.Linear({w}, {w}), {act}, " for _ in range(depth - 1))
        if s.defect in ("dead_relu_init", "zero_init"):
            act = "nn.ReLU()"
            hidden = "".join(f"nn.Linear({w}, {w}), nn.ReLU(), " for _ in range(depth - 1))
        model = f'''
D, C, B = 12, 5, 32
teacher = torch.randn(D, C, generator=gen)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, {w}), {act}, {hidden})
        self.head = nn.Linear({w}, C)

    def forward(self, x):
        return self.head(self.body(x){det})
'''
        batch = '''
def get_batch(step):
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    x = torch.randn(B, D, generator=g)
    return x, LABELS
'''
    elif f == "cnn_bn":
        model = f'''
C, B = 4, 16
teacher = torch.randn(C, 1, 8, 8, generator=gen)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Flatten())
        self.head = nn.Linear(8 * 8 * 8, C)

    def forward(self, x):
        return self.head(self.body(x){det})
'''
        batch = '''
def get_batch(step):
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    x = torch.randn(B, 1, 8, 8, generator=g)
    return x, LABELS
'''
    elif f == "rnn":
        model = f'''
D, C, B, T = 6, 4, 16, 8
teacher = torch.randn(D, C, generator=gen)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.{e["rnn_cell"]}(D, {w}, num_layers={e["layers"]}, batch_first=True)
        self.head = nn.Linear({w}, C)

    def forward(self, x):
        h, _ = self.body(x)
        return self.head(h[:, -1]{det})
'''
        batch = '''
def get_batch(step):
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    x = torch.randn(B, T, D, generator=g)
    return x, LABELS
'''
    elif f in ("tf_preln", "tf_postln"):
        nf = "True" if f == "tf_preln" else "False"
        model = f'''
D, C, B, T = 8, 4, 16, 6
teacher = torch.randn(D, C, generator=gen)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True,
                                           norm_first={nf})
        self.proj = nn.Linear(D, 16)
        self.body = nn.TransformerEncoder(layer, num_layers={e["tf_layers"]}, enable_nested_tensor=False)
        self.head = nn.Linear(16, C)

    def forward(self, x):
        return self.head(self.body(self.proj(x)).mean(1){det})
'''
        batch = '''
def get_batch(step):
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    x = torch.randn(B, T, D, generator=g)
    return x, LABELS
'''
    elif f == "vae":
        model = f'''
D, Z, B = 16, 4, 32
basis = torch.randn(Z, D, generator=gen)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(D, {w}), nn.ReLU(), nn.Linear({w}, 2 * Z))
        self.dec = nn.Sequential(nn.Linear(Z, {w}), nn.ReLU(), nn.Linear({w}, D))

    def forward(self, x):
        mu, logvar = self.enc(x).chunk(2, dim=-1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(z), mu, logvar
'''
        batch = '''
def get_batch(step):
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    x = torch.randn(B, Z, generator=g) @ basis
    return x, x
'''
    elif f == "diffusion":
        model = f'''
D, B, NT = 8, 32, 50
betas = torch.linspace(1e-4, 0.2, NT)
alpha_bar = torch.cumprod(1 - betas, 0)
centres = torch.randn(3, D, generator=gen) * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.temb = nn.Embedding(NT, 8)
        self.body = nn.Sequential(nn.Linear(D + 8, {w}), {act}, nn.Linear({w}, {w}), {act}, nn.Linear({w}, D))

    def forward(self, x, t):
        return self.body(torch.cat([x, self.temb(t){det}], dim=-1))
'''
        batch = '''
def get_batch(step):
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    x0 = centres[torch.randint(0, 3, (B,), generator=g)] + 0.1 * torch.randn(B, D, generator=g)
    t = torch.randint(0, NT, (B,), generator=g)
    noise = torch.randn(B, D, generator=g)
    ab = alpha_bar[t][:, None]
    return (ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t), noise
'''
    elif f == "embedding_lm":
        model = f'''
V, B, T = 60, 32, 5


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Embedding(V, {w}, sparse={e["sparse"]})
        self.head = nn.Linear({w}, V)

    def forward(self, x):
        return self.head(self.body(x).mean(1){det})
'''
        batch = '''
def get_batch(step):
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    x = torch.randint(0, V, (B, T), generator=g)
    return x, LABELS
'''
    else:
        raise ValueError(f)
    if f in CLASSIFIERS:
        if s.defect == "random_labels":
            labels = "torch.randint(0, {n}, (x.shape[0],), generator=g)"
        elif f == "embedding_lm":
            labels = "(x[:, -1] * 7 + x[:, 0]) % V"
        elif f in ("rnn", "tf_preln", "tf_postln"):
            labels = "(x.mean(1) @ teacher).argmax(-1)"
        elif f == "cnn_bn":
            labels = "torch.einsum('bchw,kchw->bk', x, teacher).argmax(-1)"
        else:
            labels = "(x @ teacher).argmax(-1)"
        labels = labels.replace("{n}", "V" if f == "embedding_lm" else "C")
        batch = batch.replace("LABELS", labels)
    return model + batch


def _loss(s: Spec) -> str:
    """``def loss_of(batch) -> loss`` for a supervised family (the defects of the loss written in)."""
    f = s.family
    if f == "vae":
        return '''
def loss_of(x, y):
    recon, mu, logvar = model(x)
    rec = F.mse_loss(recon, y, reduction="sum")
    kl = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return (rec + kl) / x.shape[0] * 8
'''
    call = "model(*x)" if f == "diffusion" else "model(x)"
    if s.defect == "log_zero":
        target = "(y % 2).float()" if f in CLASSIFIERS else "(y.mean(-1) > 0).float()"
        return f'''
def loss_of(x, y):
    out = {call}
    p = (0.5 + out.sum(-1)).clamp(0, 1)   # a probability from a linear head, clamped
    t = {target}
    return -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean()
'''
    if f in CLASSIFIERS:
        inner = "F.softmax(out, dim=-1)" if s.defect == "softmax_ce" else "out"
        return f'''
def loss_of(x, y):
    out = {call}
    return F.cross_entropy({inner}, y)
'''
    return f'''
def loss_of(x, y):
    return F.mse_loss({call}, y)
'''


def _setup(s: Spec) -> str:
    """The model built, its initialisation defects, the optimizer and schedule."""
    d = s.defect
    out = ["\nmodel = Net()"]
    if d == "dead_relu_init":
        out.append(f"nn.init.constant_({RELU_FIRST[s.family]}.bias, -10.0)   # every unit of the first layer off")
    if d == "zero_init":
        out.append("for m in model.body:\n    if isinstance(m, nn.Linear):\n        nn.init.zeros_(m.weight)\n"
                   "        nn.init.zeros_(m.bias)")
    if d == "exploding_init":
        out.append("for m in model.body:\n    if isinstance(m, nn.Linear):\n"
                   "        nn.init.normal_(m.weight, std=6.0 / math.sqrt(m.in_features))")
    if d == "unused_param":
        out.append("model.aux = nn.Linear(4, 4)   # registered, handed to the optimizer, never called")
    if d == "frozen_body":
        body = "model.enc" if s.family == "vae" else "model.body"
        out.append(f"{body}.requires_grad_(False)")
    lr = lr_of(s)
    out.append(f"LR = {lr!r}")
    params = "model.parameters()"
    o = s.opt
    if o == "sgd":
        wd = ", weight_decay=4.0" if d == "weight_decay_drag" else ""
        sparse = s.family == "embedding_lm" and s.extra["sparse"]
        mom = "" if sparse else ", momentum=0.9"
        out.append(f"opt = torch.optim.SGD({params}, lr=LR{mom}{wd})")
    elif o == "adam":
        out.append(f"opt = torch.optim.Adam({params}, lr=LR)")
    elif o == "adamw":
        wd = 100.0 if d == "weight_decay_drag" else 0.01
        lr_line = ", lr=0.002" if d == "weight_decay_drag" else ", lr=LR"
        out.append(f"opt = torch.optim.AdamW({params}{lr_line}, weight_decay={wd})")
    elif o == "rmsprop":
        out.append(f"opt = torch.optim.RMSprop({params}, lr=LR)")
    elif o == "lbfgs":
        out.append(f"opt = torch.optim.LBFGS({params}, lr=LR, max_iter=4, history_size=5, "
                   "line_search_fn='strong_wolfe')")
    elif o == "lion":
        out.append(CUSTOM_OPT["lion"])
        out.append(f"opt = Lion({params}, lr=LR)")
    elif o == "heavy_ball":
        out.append("velocity = {}   # one momentum buffer per parameter")
    elif o == "custom":
        out.append(CUSTOM_OPT[s.extra["custom_kind"]])
        out.append(f"opt = {'ScheduleFreeSGD' if s.extra['custom_kind'] == 'schedule_free' else 'SignSGD'}"
                   f"({params}, lr=LR)")
    if s.family == "embedding_lm" and s.extra["sparse"] and o in ("adam", "adamw", "rmsprop"):
        # sparse rows: SparseAdam for the embedding, the chosen optimizer for the rest
        out[-1] = out[-1].replace(params, "model.head.parameters()")
        out.append("opt_emb = torch.optim.SparseAdam(model.body.parameters(), lr=0.01)")
    out.append(_sched(s))
    if s.scaler:
        out.append('scaler = torch.amp.GradScaler("cpu")')
    return "\n".join(x for x in out if x) + "\n"


CUSTOM_OPT = {
    "schedule_free": '''

class ScheduleFreeSGD(torch.optim.Optimizer):
    """SGD on a base sequence z, evaluated at an average x of it (schedule-free style, no momentum buffer)."""

    def __init__(self, params, lr=0.05, beta=0.9):
        super().__init__(params, dict(lr=lr, beta=beta))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["z"] = p.detach().clone()
                    st["k"] = 0
                st["k"] += 1
                st["z"].add_(p.grad, alpha=-group["lr"])
                c = 1.0 / st["k"]
                p.mul_(1 - c).add_(st["z"], alpha=c)
''',
    "lion": '''

class Lion(torch.optim.Optimizer):
    """Sign of an interpolated momentum (Lion-style), with decoupled weight decay."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_((b1 * m + (1 - b1) * p.grad).sign(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
''',
    "sign_sgd": '''

class SignSGD(torch.optim.Optimizer):
    """A hand-written optimizer: the update is lr * sign(grad), decayed by the gradient's size."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign() * p.grad.abs().clamp(max=1.0), alpha=-group["lr"] * 0.2)
''',
}


EPOCH = 5


def _sched(s: Spec) -> str:
    if s.opt in ("manual", "heavy_ball"):
        return ""
    d = s.defect
    if d == "sched_collapse":
        if s.extra["collapse"] == "step":
            return "scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)"
        return "scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1 ** s)"
    if d == "sched_negative":
        return "scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 8)   # linear decay, no floor"
    n = STEPS if s.sched_per == "batch" else STEPS // EPOCH
    return {"none": "",
            "warmup": f"scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / {max(2, n // 5)}))",
            "cosine": f"scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max={n})",
            "step": f"scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size={max(1, n // 3)}, gamma=0.5)",
            "lambda": "scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.97 ** s)"}[s.sched]


def _has_sched(s: Spec) -> bool:
    return bool(_sched(s))


def _loop(s: Spec) -> str:
    d, k = s.defect, s.accum
    i = "    "
    xs = "x[0]" if s.family == "diffusion" else "x"

    def nan_at(ind: str, cond: str) -> str:
        if d not in ("nan_batch", "bn_nan_batch"):
            return ""
        return f"{ind}if {cond}:\n{ind}    {xs}[0].fill_(float('nan'))   # a corrupt sample\n"
    nan = nan_at(i, f"step == {s.extra['nan_step']}")
    flip = "-" if d == "sign_flip" else ""
    if s.opt == "lbfgs":
        clip = f"{i}    torch.nn.utils.clip_grad_norm_(model.parameters(), {s.clip})\n" if s.clip else ""
        return (f"\nfor step in range(STEPS):\n{i}x, y = get_batch(step)\n{nan}\n"
                f"{i}def closure():\n{i}    opt.zero_grad()\n{i}    loss = {flip}loss_of(x, y)\n{i}    loss.backward()\n"
                f"{clip}{i}    return loss\n\n{i}opt.step(closure)\n")
    if s.opt in ("manual", "heavy_ball"):
        zero = "" if d == "no_zero_grad" else f"{i}        p.grad = None\n"
        if d == "zero_grad_every_k":
            zero = ""
        clip = f"{i}torch.nn.utils.clip_grad_norm_(model.parameters(), {s.clip})\n" if s.clip and \
            d != "clip_before_backward" else ""
        pre = f"{i}torch.nn.utils.clip_grad_norm_(model.parameters(), {s.clip})\n" if d == "clip_before_backward" \
            else ""
        return (f"\nfor step in range(STEPS):\n{i}x, y = get_batch(step)\n{nan}{pre}{i}loss = {flip}loss_of(x, y)\n"
                f"{i}loss.backward()\n{clip}{i}with torch.no_grad():\n{i}    for p in model.parameters():\n"
                f"{i}        if p.grad is None:\n{i}            continue\n" + (
                    f"{i}        p -= LR * p.grad\n" if s.opt == "manual" else
                    f"{i}        v = velocity.setdefault(p, torch.zeros_like(p))\n{i}        v.mul_(0.9).add_(p.grad)\n"
                    f"{i}        p -= LR * v\n") + zero)
    opts = ["opt"] + (["opt_emb"] if s.family == "embedding_lm" and s.extra["sparse"] and
                      s.opt in ("adam", "adamw", "rmsprop") else [])
    zero = "".join(f"{i}{o}.zero_grad(set_to_none=True)\n" for o in opts)
    if d == "no_zero_grad":
        zero = ""
    if d == "zero_grad_every_k":
        zero = f"{i}if step % {s.extra['k']} == 0:   # zeroed every few steps only\n" + \
            "".join(f"{i}    {o}.zero_grad(set_to_none=True)\n" for o in opts)
    out = [f"\nfor step in range(STEPS):\n{zero}"]
    if d == "clip_before_backward":
        out.append(f"{i}torch.nn.utils.clip_grad_norm_(model.parameters(), {s.clip})\n")
    div = "" if (k == 1 or d == "loss_not_divided") else f" / {k}"
    body = f"{i}    x, y = get_batch(step * {k} + micro)\n" + nan_at(
        i + "    ", f"step == {s.extra['nan_step']} and micro == 0")
    if k > 1:
        out.append(f"{i}for micro in range({k}):\n{body}")
        bwd_i = i + "    "
    else:
        out.append(f"{i}x, y = get_batch(step)\n{nan}")
        bwd_i = i
    out.append(f"{bwd_i}loss = {flip}loss_of(x, y){div}\n")
    out.append(f"{bwd_i}scaler.scale(loss).backward()\n" if s.scaler else f"{bwd_i}loss.backward()\n")
    clip = f"{i}torch.nn.utils.clip_grad_norm_(model.parameters(), {s.clip})\n" if s.clip else ""
    if d == "clip_before_unscale":
        out.append(clip + f"{i}scaler.unscale_(opt)\n")
    elif d != "clip_before_backward":
        out.append((f"{i}scaler.unscale_(opt)\n" if s.scaler and clip else "") + clip)
    if s.scaler:
        out.append(f"{i}scaler.step(opt)\n{i}scaler.update()\n")
    else:
        out.append(f"{i}opt.step()\n")
    out.extend(f"{i}{o}.step()\n" for o in opts[1:])
    if _has_sched(s):
        if s.sched_per == "batch" or d in ("sched_collapse", "sched_negative"):
            out.append(f"{i}scheduler.step()\n")
        else:
            out.append(f"{i}if (step + 1) % {EPOCH} == 0:   # per epoch\n{i}    scheduler.step()\n")
    return "".join(out)


def _own_loop(s: Spec) -> str:
    """The whole body of a family with its own loop (GAN, WGAN, policy gradient, actor-critic)."""
    f, d, e = s.family, s.defect, s.extra
    lr = lr_of(s)
    nan = e["nan_step"]
    sched = ""
    if d == "sched_collapse":
        sched = "torch.optim.lr_scheduler.LambdaLR({o}, lambda s: 0.1 ** s)"
    elif d == "sched_negative":
        sched = "torch.optim.lr_scheduler.LambdaLR({o}, lambda s: 1 - s / 8)"
    elif s.sched == "cosine":
        sched = "torch.optim.lr_scheduler.CosineAnnealingLR({o}, T_max=STEPS)"
    elif s.sched == "lambda":
        sched = "torch.optim.lr_scheduler.LambdaLR({o}, lambda s: 0.97 ** s)"
    unused = "\nD.aux = nn.Linear(4, 4)   # registered, handed to the optimizer, never called" \
        if d == "unused_param" else ""
    zg = lambda o: "" if d == "no_zero_grad" else f"    {o}.zero_grad(set_to_none=True)\n"  # noqa: E731
    clip = (lambda m: f"    torch.nn.utils.clip_grad_norm_({m}.parameters(), {s.clip})\n") if s.clip else \
        (lambda m: "")
    if f in ("gan", "wgan"):
        OptD = "torch.optim.RMSprop" if s.opt == "rmsprop" else "torch.optim.Adam"
        betas = ", betas=(0.5, 0.9)" if OptD.endswith("Adam") else ""
        dlr = lr if d == "lr_high" else (5e-4 if f == "wgan" else 2e-3)
        head = f'''
D_IN, Z, B = 4, 8, 64
real_mean = torch.randn(D_IN, generator=gen) + 2.0
G = nn.Sequential(nn.Linear(Z, 32), nn.ReLU(), nn.Linear(32, D_IN))
D = nn.Sequential(nn.Linear(D_IN, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1)){unused}
opt_g = {OptD}(G.parameters(), lr={dlr!r}{betas})
opt_d = {OptD}(D.parameters(), lr={dlr!r}{betas})
'''
        if sched:
            head += f"sched_d = {sched.format(o='opt_d')}\nsched_g = {sched.format(o='opt_g')}\n"
        head += "progress = []\n"
        real = f'''    g = torch.Generator().manual_seed(SEED * 7919 + step)
    real = real_mean + 0.5 * torch.randn(B, D_IN, generator=g)
    if step == {nan} and {d == "nan_batch"}:
        real[0, 0] = float("nan")   # a corrupt sample
'''
        fake_g = "G(torch.randn(B, Z, generator=g))"
        gdet = ".detach()" if d == "detach_subnet" else ""
        if f == "gan":
            gp = ""
            if e["gp"]:
                gp = '''    real.requires_grad_(True)
    d_real = D(real)
    grad, = torch.autograd.grad(d_real.sum(), real, create_graph=True)
    loss_d = loss_d + 0.5 * grad.pow(2).sum(1).mean()   # R1 penalty (double backward)
'''
            loop = f'''
bce = nn.BCEWithLogitsLoss()
for step in range(STEPS):
{real}    fake = {fake_g}
{zg("opt_d")}    loss_d = bce(D(real), torch.ones(B, 1)) + bce(D(fake.detach()), torch.zeros(B, 1))
{gp}    loss_d.backward()
    opt_d.step()
{zg("opt_g")}    loss_g = bce(D(fake{gdet}), torch.ones(B, 1))
    loss_g.backward()
    opt_g.step()
'''
        else:
            loop = f'''
for step in range(STEPS):
{real}    for _ in range(3):
{zg("opt_d").replace("    ", "        ", 1)}        fake = {fake_g}
        loss_d = D(fake.detach()).mean() - D(real).mean()
        loss_d.backward()
        opt_d.step()
        with torch.no_grad():
            for p in D.parameters():
                p.clamp_(-0.05, 0.05)   # weight clipping
{zg("opt_g")}    fake = {fake_g}
    loss_g = -D(fake).mean()
    loss_g.backward()
    opt_g.step()
'''
        loop += "    progress.append(-float((fake.mean(0) - real_mean).abs().mean()))\n"
        if sched:
            loop += "    sched_d.step()\n    sched_g.step()\n"
        return head + loop
    if f == "policy_gradient":
        Opt = "torch.optim.Adam" if s.opt == "adam" else "torch.optim.SGD"
        lr = lr_of(replace(s, lr=(3e-3 if s.opt == "adam" else 0.1))) if d in ("lr_high", "lr_low") else \
            (3e-3 if s.opt == "adam" else 0.1)
        if d == "lr_high":
            lr = 2.0 if s.opt == "adam" else 200.0
        unused = unused.replace("D.aux", "policy.aux")
        head = f'''
D_IN, A, B = 6, 4, 64
teacher = torch.randn(D_IN, A, generator=gen)
policy = nn.Sequential(nn.Linear(D_IN, 32), nn.Tanh(), nn.Linear(32, A)){unused}
opt = {Opt}(policy.parameters(), lr={lr!r})
'''
        if sched:
            head += f"scheduler = {sched.format(o='opt')}\n"
        loop = f'''progress = []
for step in range(STEPS):
    g = torch.Generator().manual_seed(SEED * 7919 + step)
    x = torch.randn(B, D_IN, generator=g)
    if step == {nan} and {d == "nan_batch"}:
        x[0, 0] = float("nan")   # a corrupt observation
    dist = torch.distributions.Categorical(logits=policy(x))
    a = dist.sample()
    reward = (a == (x @ teacher).argmax(-1)).float()
    adv = reward - reward.mean()
{zg("opt")}    loss = -(dist.log_prob(a) * adv).mean() - 0.01 * dist.entropy().mean()   # signed objective
    loss.backward()
{clip("policy")}    opt.step()
'''
        if sched:
            loop += "    scheduler.step()\n"
        return head + loop + "    progress.append(float(reward.mean()))\n"
    if f == "actor_critic":
        lr_a, lr_c = (3e-3, 1e-2)
        if d == "lr_high":
            lr_a, lr_c = 1.0, 3.0
        if d == "lr_low":
            lr_a, lr_c = 3e-9, 1e-8
        unused = unused.replace("D.aux", "critic.aux")
        head = f'''
N, B, GAMMA = 8, 32, 0.9
actor = nn.Sequential(nn.Linear(N, 32), nn.Tanh(), nn.Linear(32, 2))
critic = nn.Sequential(nn.Linear(N, 32), nn.Tanh(), nn.Linear(32, 1)){unused}
target = nn.Sequential(nn.Linear(N, 32), nn.Tanh(), nn.Linear(32, 1))
target.load_state_dict(critic.state_dict())
opt_a = torch.optim.Adam(actor.parameters(), lr={lr_a!r})
opt_c = torch.optim.Adam(critic.parameters(), lr={lr_c!r})
'''
        if sched:
            head += f"sched_c = {sched.format(o='opt_c')}\n"
        loop = f'''state = torch.zeros(B, dtype=torch.long)
progress = []
for step in range(STEPS):
    s = F.one_hot(state, N).float()
    if step == {nan} and {d == "nan_batch"}:
        s[0, 0] = float("nan")   # a corrupt observation
    dist = torch.distributions.Categorical(logits=actor(s))
    a = dist.sample()
    nxt = (state + 2 * a - 1).clamp(0, N - 1)
    reward = (nxt == N - 1).float()
    done = reward
    s2 = F.one_hot(nxt, N).float()
    with torch.no_grad():
        td_target = reward + GAMMA * (1 - done) * target(s2).squeeze(-1)   # bootstrapped
    v = critic(s).squeeze(-1)
{zg("opt_c")}    loss_c = F.mse_loss(v, td_target)
    loss_c.backward()
{clip("critic")}    opt_c.step()
{zg("opt_a")}    adv = (td_target - v).detach()
    loss_a = -(dist.log_prob(a) * adv).mean() - 0.01 * dist.entropy().mean()
    loss_a.backward()
{clip("actor")}    opt_a.step()
    with torch.no_grad():
        for pt, pc in zip(target.parameters(), critic.parameters()):
            pt.mul_(0.9).add_(pc, alpha=0.1)   # the target network follows the critic
    state = torch.where(done.bool(), torch.zeros_like(nxt), nxt)
    progress.append(float(reward.mean()))
'''
        if sched:
            loop += "    sched_c.step()\n"
        return head + loop
    raise ValueError(f)


def script_of(s: Spec) -> str:
    """The complete script of ``s``."""
    text = HEAD.format(seed=s.seed, family=s.family, defect=s.defect or "none", steps=STEPS)
    if s.family in OWN_LOOP:
        return text + _own_loop(s)
    return text + _model(s) + _loss(s) + _setup(s) + _loop(s)
