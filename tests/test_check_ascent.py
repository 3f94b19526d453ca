"""``gradient_ascent``: a script whose optimizer climbs its loss (a loss function negated before backward(), or
an optimizer built with ``maximize=True``). The sign is read off the autograd graph on the host; the rule is
tested against its nearest wrong variants on hand-built records, and on a real script (tests/check_scripts/
sign_flipped_loss.py) that records its cross-entropy in float64 without fastgrad, with its clean twin and a
loss that subtracts an adversarial term on purpose."""

import math

import pytest
import torch
import torch.nn.functional as F

from fastgrad.diagnose.collect.loss_inputs import criterion_sign
from fastgrad.diagnose.collect.steps import StepRecord
from fastgrad.diagnose.rules.ascent import GRADIENT_ASCENT, ascent_variant
from fastgrad.diagnose.rules.base import RunView
from fastgrad.diagnose.thresholds import RunLimits

from .check_runs import checked_once, codes

_cache: dict = {}


def run(tmp_path_factory, *args):
    return checked_once(_cache, tmp_path_factory, "sign_flipped_loss.py", *args)


# ---------------------------------------------------------------------------------------------- the graph's sign
def test_criterion_sign_reads_the_sign_a_loss_function_enters_with():
    torch.manual_seed(0)
    x = torch.randn(6, 4, requires_grad=True)
    y = torch.randint(0, 4, (6,))
    ce = lambda: F.cross_entropy(x, y)
    mse = lambda: F.mse_loss(x, torch.zeros(6, 4), reduction="sum")
    hand = (x ** 2).sum()   # a term written by hand: no loss function's node
    neg = (1, 0)
    cases = {
        "as returned": (ce(), (0, 1)),
        "a positive factor and a division": (ce() * 8 / 3, (0, 1)),
        "a minus sign": (-ce(), neg),
        "a minus sign, divided": (-ce() / 4, neg),
        "a negative factor": (ce() * -1, neg),
        "a negative CPU scalar tensor": (ce() * torch.tensor(-2.0), neg),
        "one minus the loss": (1 - ce(), neg),
        "a summed loss negated (a VAE's)": (-((mse() + hand) / 6 * 8), neg),
        "a loss minus another (adversarial)": (ce() - 0.1 * mse(), (1, 1)),
        "a cast": (-ce().half(), neg),
        "negated twice": (-(-ce()), (0, 1)),
    }
    for name, (t, want) in cases.items():
        assert criterion_sign(t)[:2] == want, name
    assert criterion_sign(-ce())[2] == "NllLossBackward0"
    # no sign known without reading a device value, or no loss function under it: nothing counted
    weighted = (F.cross_entropy(x, y, reduction="none") * torch.randn(6)).mean()   # a policy gradient's weights
    assert criterion_sign(weighted)[:2] == (0, 0)
    assert criterion_sign(-(-(x.log_softmax(1)[:, 0]).mean()))[:2] == (0, 0)
    assert criterion_sign(x.sum() * ce())[:2] == (0, 0)
    assert criterion_sign(torch.tensor(1.0))[:2] == (0, 0)
    # a graph it cannot read (its saved tensors freed by an earlier backward) is unknown, never an error: the
    # read runs inside the script's own backward() and GradScaler.scale
    freed = F.cross_entropy(x, y) * torch.tensor(-3.0)
    freed.backward()
    with pytest.raises(RuntimeError):
        freed.grad_fn._saved_other
    assert criterion_sign(freed) == (0, 0, None)


# ---------------------------------------------------------------------------------------------- the rule's bounds
def test_ascent_variant_sits_between_its_rule_and_the_nearest_wrong_variants():
    share = RunLimits.ascent_share
    n = 20
    at = math.ceil(share * n)
    assert ascent_variant({"calls": n, "negated": at, "kept": 0}, [False], share) == "negated"
    assert ascent_variant({"calls": n, "negated": at - 1, "kept": 0}, [False], share) is None
    assert ascent_variant({"calls": n, "negated": n - 1, "kept": 1}, [False], share) is None   # one kept: meant
    assert ascent_variant({"calls": 0, "negated": 0, "kept": 0}, [False], share) is None
    assert ascent_variant({"calls": n, "negated": 0, "kept": at}, [True], share) == "maximize"
    assert ascent_variant({"calls": n, "negated": 0, "kept": at - 1}, [True], share) is None
    assert ascent_variant({"calls": n, "negated": 0, "kept": n}, [False], share) is None
    assert ascent_variant({"calls": n, "negated": 0, "kept": n}, [True, False], share) is None  # whose calls?
    assert ascent_variant({"calls": n, "negated": 1, "kept": n - 1}, [True], share) is None


def _view(losses, negated=True):
    steps = [StepRecord(step=i + 1, has_loss=True, loss=v, total_norm=1.0) for i, v in enumerate(losses)]
    n = len(losses)
    signs = {"calls": n, "negated": n if negated else 0, "kept": 0 if negated else n, "node": "NllLossBackward0"}
    return RunView(steps=steps, ctx={"loss_signs": signs, "maximize": [not negated]})


def test_the_tier_rests_on_the_loss_function_rising():
    falling = [-1.0 - 0.1 * i + 0.01 * (-1) ** i for i in range(20)]   # negated: the loss function rises
    flat = [-1.0 + 0.01 * (-1) ** i for i in range(20)]
    rising = [1.0 + 0.1 * i + 0.01 * (-1) ** i for i in range(20)]
    assert [f.severity for f in GRADIENT_ASCENT.evaluate(_view(falling))] == ["warning"]
    assert [f.severity for f in GRADIENT_ASCENT.evaluate(_view(flat))] == ["notice"]
    assert [f.severity for f in GRADIENT_ASCENT.evaluate(_view(rising))] == ["notice"]    # negated, yet improving
    assert [f.severity for f in GRADIENT_ASCENT.evaluate(_view(rising, negated=False))] == ["warning"]
    assert [f.severity for f in GRADIENT_ASCENT.evaluate(_view(falling, negated=False))] == ["notice"]
    nan = falling[:10] + [math.nan] + falling[11:]
    f = GRADIENT_ASCENT.evaluate(_view(flat[:10] + [math.nan] + flat[11:]))[0]
    assert f.severity == "warning" and "NaN/Inf" in f.detail
    assert GRADIENT_ASCENT.evaluate(_view(nan))[0].severity == "warning"


# ---------------------------------------------------------------------------------------------- real runs
@pytest.mark.parametrize("mode", ["", "--maximize", "--amp"])
def test_a_loss_the_optimizer_climbs_is_named_first(mode, tmp_path_factory):
    r = run(tmp_path_factory, *([mode] if mode else []))
    ce = [t["loss"] for t in r["truth"]["steps"]]
    q = len(ce) // 4
    assert sum(ce[-q:]) / q > 2 * sum(ce[:q]) / q          # the truth: the cross-entropy climbed
    f = r["json"]["findings"][0]
    assert f["code"] == "gradient_ascent" and f["severity"] == "warning"
    assert f["evidence"]["variant"] == ("maximize" if mode == "--maximize" else "negated")
    assert f["evidence"]["node"] == "NllLossBackward0" and f["evidence"]["calls"] == 40
    for g in r["json"]["findings"][1:]:   # what it drives names it; no trend stands beside it
        assert g["code"] not in ("spike", "increasing", "elevated", "decaying")
        if g["severity"] != "notice":
            assert g["evidence"].get("follows") == "gradient_ascent", g["code"]
    rec = r["json"]["recommendations"][0]
    assert rec["code"] == "gradient_ascent" and "learning rate" not in rec["text"]
    assert "opt" in rec["code_to_add"] and "optimizer" not in rec["code_to_add"]   # the script's own names
    if mode != "--maximize":
        # the recorded loss is -ce / 2: the quote is its own first and last quarters (loss_change's, q >= 2)
        k = max(2, len(ce) // 4)
        first, last = -sum(ce[:k]) / k / 2, -sum(ce[-k:]) / k / 2
        assert f"{first:.3g}"[:4] in f["detail"] and f"{last:.3g}"[:4] in f["detail"]


@pytest.mark.parametrize("mode", ["--fixed", "--adversarial"])
def test_a_loss_as_returned_or_an_adversarial_term_is_not_ascent(mode, tmp_path_factory):
    r = run(tmp_path_factory, mode)
    ce = [t["loss"] for t in r["truth"]["steps"]]
    assert ce[-1] < ce[0]                                   # the truth: it learns
    assert "gradient_ascent" not in codes(r) and r["rc"] == 0
