"""The corpus's manifest: for each run (a script of this folder and its arguments) the report a demanding user
should get from ``python -m fastgrad.check``, written from the run's own float64 truth (recorded without
fastgrad by tests/check_corpus/_corpus.py) before check ran on it.

Each case says:
  rc        the exit code (0 unless a critical finding backed by harm; 1 with one; 3 when the script crashed);
            a tuple where the worst severity may be either of two and the code follows from it
  worst     (least, most) severity of the report's worst finding ("healthy" when there is none)
  must      code -> the least severity it must have; "a|b" is satisfied by either code
  must_not  codes that must not appear at warning or above
  names     regular expressions the text report must contain (module paths, optimizers, steps, variables)
  absent    regular expressions the text report must not contain (advice the script cannot run)
  first     the code (or "a|b") of the report's first finding, where cause-before-effect matters
  rows      summary-row metric (its label's start) -> the least status it must have (a row must not call
            healthy what the run's truth shows as harm); besides, no row is ever more severe than the worst
            finding (tests/test_check_corpus.py checks that for every case)
  why       the expectation in one line, from the truth
  premise   the truth facts ``why`` rests on, checked on the truth recorded in the same run
  today     None when today's check gets the case right, else why it does not (the test is then an
            xfail(strict=True): it turns green, and must be unmarked, when the rules get it right)
"""
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

PE = "pytorch/examples@77f55b912142e11fcfdf5b530231fb9c52f181e8"
DIFFUSERS = ("huggingface/diffusers@58eb52c0803ea9af3abec60841c2a093bdf1f951 "
             "examples/unconditional_image_generation/train_unconditional.py")


@dataclass(frozen=True)
class Case:
    script: str
    args: tuple
    source: str
    variant: str
    why: str
    premise: Callable
    rc: object = 0
    worst: tuple = ("healthy", "notice")
    must: dict = field(default_factory=dict)
    must_not: tuple = ()
    names: tuple = ()
    absent: tuple = ()
    first: str | None = None
    rows: dict = field(default_factory=dict)
    today: str | None = None


# ------------------------------------------------------------------------------------------ truth helpers
def num(v) -> float:
    return float(v)  # "nan" / "inf" strings as the truth file writes non-finite values


def rows(t, opt=None):
    return [r for r in t["steps"] if opt is None or r.get("opt", "") == opt]


def losses(t, opt=None):
    return [num(r["loss"]) for r in rows(t, opt) if not r.get("skipped")]


def norms(t, opt=None, key="norm"):
    return [num(r[key]) for r in rows(t, opt) if key in r]


def ratios(t, opt=None):
    return [num(r["ratio"]) for r in rows(t, opt) if "ratio" in r]


def quarter(xs, last=False):
    q = max(1, len(xs) // 4)
    return statistics.median(xs[-q:] if last else xs[:q])


def falls(t, by, opt=None):
    """The last quarter's median loss at least ``by`` (a fraction) below the first quarter's."""
    ls = losses(t, opt)
    return quarter(ls, last=True) <= (1 - by) * quarter(ls)


def never(t, prefix, kind="absent", opt=None):
    """Every tensor named ``prefix``... had no gradient (kind "absent") or an all-zero one ("zero") at every
    step, and there is at least one such tensor."""
    rs = rows(t, opt)
    return bool(rs[0].get(kind)) and all(
        any(n.startswith(prefix) for n in r.get(kind, ())) for r in rs) and all(
        set(n for n in r.get(kind, ()) if n.startswith(prefix)) == set(
            n for n in rs[0][kind] if n.startswith(prefix)) for r in rs)


def finite_all(t, key="norm"):
    return all(math.isfinite(x) for x in norms(t, key=key))


# ------------------------------------------------------------------------------------------ the cases
CASES = {
    # ---- pytorch/examples: the kinds of run issue 45 names, reconstructed
    "pe_wlm_healthy": Case(
        "pe_word_language_model.py", (), PE + " word_language_model/main.py", "healthy (LSTM, hand SGD lr 20)",
        "loss 3.40 -> 2.98 (quarters 3.15 -> 3.04), pre-clip norm ~0.12 under the 0.25 clip, no optimizer: "
        "healthy; the hand-written loop is at most a notice",
        lambda t: falls(t, 0.02) and statistics.median(norms(t, key="raw")) < 0.25 and finite_all(t),
        must_not=("exploding", "loss_diverging", "stall", "depth_vanishing"), absent=(r"param_groups",)),
    "pe_wlm_lr2000": Case(
        "pe_word_language_model.py", ("--lr", "2000"), PE + " word_language_model/main.py", "--lr 2000 (100x)",
        "loss 3.40 -> 769 (last-quarter median 240x the start) while every pre-clip norm stays < 42 and the "
        "clip bounds the update: the learning rate diverges the run (critical); the fix is the script's own "
        "`lr` (no optimizer to take param_groups from), not a clip",
        lambda t: quarter(losses(t), last=True) > 100 * losses(t)[0] and max(norms(t, key="raw")) < 50,
        rc=1, worst=("critical", "critical"), must={"loss_diverging": "critical"}, first="loss_diverging",
        must_not=("exploding",), names=(r"\blr\s*(/=|\*=|=)",), absent=(r"param_groups",)),
    "pe_wlm_deep_tanh": Case(
        "pe_word_language_model.py", ("--model", "RNN_TANH", "--nlayers", "10"), PE + " word_language_model/main.py",
        "--model RNN_TANH --nlayers 10",
        "layer 0 of the stacked tanh RNN gets 1e-4..1e-2 of layer 9's gradient (88x less at step 1, 4.5e4x at "
        "the last) and the loss never gets below its start (3.42; last quarter 3.62, chance 3.40): depth "
        "vanishing named at the stacked layer (warning), no explosion, no ReLU advice for a model without ReLUs",
        lambda t: (t["steps"][-1]["layers"]["rnn.weight_ih_l0"] * 1000 < t["steps"][-1]["layers"]["rnn.weight_ih_l9"]
                   and quarter(losses(t), last=True) > losses(t)[0]),
        worst=("warning", "warning"), must={"depth_vanishing": "warning"}, must_not=("exploding",),
        names=(r"weight_ih_l0|rnn\W*(layer|l)\s*0\b",), absent=(r"LeakyReLU", r"param_groups")),
    "pe_lbfgs_healthy": Case(
        "pe_time_sequence_prediction.py", (), PE + " time_sequence_prediction/train.py", "healthy (LBFGS closure)",
        "loss 0.52 -> 0.0015 in 6 LBFGS steps, the norm falls with it (0.51 -> 0.0033) because the fit "
        "converges: healthy, the falling norm is not 'decaying' or 'vanishing'",
        lambda t: losses(t)[-1] < 0.01 * losses(t)[0],
        must_not=("decaying", "vanishing", "low", "stall", "no_learning")),
    "pe_lbfgs_no_zero_grad": Case(
        "pe_time_sequence_prediction.py", ("--bug", "no-zero-grad"), PE + " time_sequence_prediction/train.py",
        "closure without zero_grad",
        "each closure evaluation adds to the last one's gradients: norm 0.51 -> 8.4e6 and loss 0.52 -> 2e12 in 6 "
        "steps: critical, the missing zero_grad named first as the cause of the blow-up",
        lambda t: losses(t)[-1] > 1e6 * losses(t)[0],
        rc=1, worst=("critical", "critical"), must={"no_zero_grad": "warning", "loss_diverging|exploding": "warning"},
        first="no_zero_grad"),
    "pe_dcgan_healthy": Case(
        "pe_dcgan.py", (), PE + " dcgan/main.py", "healthy (two Adam)",
        "D loss 1.56 -> 1.05, G loss 0.70 -> 0.60, update/weight ratios ~2e-3 for both, all finite: healthy; "
        "G's norm rising 1.0 -> 1.4 and D's falling 8.5 -> 2.4 are the game, not findings",
        lambda t: falls(t, 0.1, "D") and falls(t, 0.05, "G") and max(ratios(t)) < 0.01,
        must_not=("spike", "increasing", "decaying", "exploding")),
    "pe_dcgan_g_detached": Case(
        "pe_dcgan.py", ("--bug", "g-detached"), PE + " dcgan/main.py", "G step on fake.detach()",
        "all 7 generator tensors have no gradient at 40/40 steps, G's loss rises 0.70 -> 0.85 while D's falls: "
        "the generator never trains (critical), its optimizer named",
        lambda t: never(t, "main.", "absent", "G") and len(rows(t, "G")[0]["absent"]) == 7,
        rc=1, worst=("critical", "critical"), must={"zero_grads|never_learns": "critical"},
        must_not=("exploding",), names=(r"optimizerG",)),
    "pe_vae_healthy": Case(
        "pe_vae.py", (), PE + " vae/main.py", "healthy (loss summed over batch and pixels)",
        "loss summed over 128x256 values: norms 1100-1560 at every step while the loss falls 23050 -> 17340 "
        "(-25%) and the update/weight ratio is ~0.01: healthy, the norm's scale belongs to the script",
        lambda t: falls(t, 0.15) and min(norms(t)) > 1000 and max(ratios(t)) < 0.02,
        must_not=("exploding", "increasing", "spike", "no_clipping")),
    "pe_vae_zero_init": Case(
        "pe_vae.py", ("--bug", "zero-init"), PE + " vae/main.py", "encoder entry layer zero-initialised",
        "fc1.weight, fc1.bias, fc21.weight and fc22.weight are exactly zero at 60/60 steps (the encoder never "
        "learns) while the loss falls less than the healthy run's: never_learns naming fc1, first",
        lambda t: never(t, "fc1.", "zero") and {"fc21.weight", "fc22.weight"} <= set(rows(t)[0]["zero"]),
        rc=(0, 1), worst=("warning", "critical"), must={"never_learns": "warning"}, first="never_learns",
        must_not=("exploding",), names=(r"\bfc1\b",)),
    "pe_reinforce_healthy": Case(
        "pe_reinforce.py", (), PE + " reinforcement_learning/reinforce.py", "healthy (RL objective that learns)",
        "episodes grow (mean length 29.5 -> 34 over the first/last 10), the signed loss has no trend to judge, "
        "norms 14 -> 7.6 (median 16), update/weight ~0.011: healthy",
        lambda t: (statistics.mean(r["episode_len"] for r in rows(t)[-10:])
                   > statistics.mean(r["episode_len"] for r in rows(t)[:10])),
        must_not=("increasing", "spike", "loss_diverging", "exploding", "stall")),
    "pe_reinforce_long": Case(
        "pe_reinforce.py", ("--episodes", "200"), PE + " reinforcement_learning/reinforce.py",
        "healthy, 200 episodes",
        "episodes grow from 29 to 77 steps (means of the first and last 25) and the gradient of a loss summed "
        "over the episode grows with them (median norm 15 -> 22, peak 64), update/weight ~0.008: an RL "
        "objective that learns, healthy; a norm that follows the episode length is not a trend to fix",
        lambda t: (statistics.mean(r["episode_len"] for r in rows(t)[-25:])
                   > 2 * statistics.mean(r["episode_len"] for r in rows(t)[:25])
                   and statistics.median(norms(t)[-25:]) > statistics.median(norms(t)[:25])),
        must_not=("increasing", "spike", "loss_diverging", "exploding", "stall", "no_clipping")),
    "pe_reinforce_no_zero_grad": Case(
        "pe_reinforce.py", ("--bug", "no-zero-grad"), PE + " reinforcement_learning/reinforce.py",
        "zero_grad left out",
        "the gradient is the running sum of every episode's: norm 14 -> 159 rising steadily, the policy stops "
        "improving (mean length 21 -> 23): no_zero_grad first, the growth said to follow from it",
        lambda t: norms(t)[-1] > 10 * norms(t)[0],
        rc=(0, 1), worst=("warning", "critical"), must={"no_zero_grad": "warning"}, first="no_zero_grad"),
    "pe_actor_critic_healthy": Case(
        "pe_actor_critic.py", (), PE + " reinforcement_learning/actor_critic.py", "healthy",
        "loss 15.5 -> 0.8 (quarters 2.2 -> 0.19) as the critic learns, norm 52 -> 1.4 with it, update/weight "
        "~0.011: healthy, the falling norm is learning",
        lambda t: falls(t, 0.5),
        must_not=("decaying", "spike", "exploding", "loss_diverging")),
    "pe_actor_critic_lr3": Case(
        "pe_actor_critic.py", ("--lr", "3"), PE + " reinforcement_learning/actor_critic.py", "--lr 3 (100x)",
        "step 1's update is 11.7x the weights; from step 2 action_head's gradient is exactly zero (the softmax "
        "saturated: a deterministic policy, episodes ~9 steps) at 57/60 steps; loss 15.5 -> 12082 at step 5: "
        "critical, action_head named",
        lambda t: ratios(t)[0] > 5 and sum("action_head.weight" in r.get("zero", ()) for r in rows(t)) >= 55,
        rc=1, worst=("critical", "critical"), names=(r"action_head",), rows={"Update/weight ratio": "warning"}),
    "pe_mnist_rnn_healthy": Case(
        "pe_mnist_rnn.py", (), PE + " mnist_rnn/main.py", "healthy (LSTM classifier, Adadelta)",
        "loss 2.48 -> 2.17 (quarters 2.33 -> 2.14, below chance 2.30), update/weight 1e-3, norm ~1: healthy",
        lambda t: falls(t, 0.05),
        must_not=("stall", "vanishing", "low")),
    "pe_mnist_rnn_frozen": Case(
        "pe_mnist_rnn.py", ("--freeze", "rnn"), PE + " mnist_rnn/main.py", "rnn frozen by a stray requires_grad",
        "the 4 rnn tensors have requires_grad=False (no gradient at 60/60 steps) while the optimizer holds them; "
        "the head learns (2.48 -> 2.32): the frozen rnn named as frozen, no warning for a deliberate setting",
        lambda t: never(t, "rnn.", "absent") and len(rows(t)[0]["absent"]) == 4,
        must_not=("never_learns", "zero_grads"), names=(r"\brnn\b", r"(?i)frozen|requires_grad")),
    "pe_mnist_healthy": Case(
        "pe_mnist.py", (), PE + " mnist/main.py", "healthy (CNN, Adadelta lr 1.0)",
        "loss 2.31 -> 0.23, norm ~1, update/weight 0.036 (the source's Adadelta at lr 1.0): healthy, a large "
        "ratio on a falling loss is no harm",
        lambda t: falls(t, 0.5) and max(ratios(t)) < 0.1),
    "pe_mnist_lr100": Case(
        "pe_mnist.py", ("--lr", "100"), PE + " mnist/main.py", "--lr 100 (100x)",
        "step 1's update is 3.5x the weights; from step 3 conv1, conv2 and fc1 get exactly-zero gradients (dead "
        "ReLUs) at 56/60 steps and the loss sits at chance (2.29-2.33, ln 10 = 2.30): critical, conv1 named",
        lambda t: max(ratios(t)) > 1 and sum("conv1.weight" in r.get("zero", ()) for r in rows(t)) >= 55
        and abs(quarter(losses(t), last=True) - math.log(10)) < 0.05,
        rc=1, worst=("critical", "critical"), names=(r"\bconv1\b",), rows={"Update/weight ratio": "warning"}),
    # ---- karpathy/nanoGPT, karpathy/minGPT
    "nanogpt_healthy": Case(
        "nanogpt_train.py", (), "karpathy/nanoGPT@3adf61e154c3fe3fca428ad6bc3818b27a3b8291 train.py",
        "healthy (AdamW, cosine, 4 micro-batches, clip 1.0)",
        "loss 3.47 -> 3.03, norms <= 0.94 under the 1.0 clip, update/weight 0.0034: healthy",
        lambda t: falls(t, 0.08) and max(norms(t, key="raw")) < 1.0),
    "nanogpt_clip_in_micro": Case(
        "nanogpt_train.py", ("--bug", "clip-in-micro-loop"),
        "karpathy/nanoGPT@3adf61e154c3fe3fca428ad6bc3818b27a3b8291 train.py", "clip inside the micro-step loop",
        "the clip sits inside the accumulation window, but every partial sum's norm is below 1.0 so it never "
        "acts: the run equals the healthy one step for step; the pattern named, nothing critical",
        lambda t: falls(t, 0.08) and max(norms(t)) < 1.0,
        worst=("notice", "warning"), must={"clip_partial": "notice"}),
    "mingpt_healthy": Case(
        "mingpt_sort.py", (), "karpathy/minGPT@37baab71b9abea1b76ab957409a1cc2fbfba8a26 mingpt/trainer.py",
        "healthy (sort task, clip 1.0)",
        "loss 1.09 -> 0.48, pre-clip norms 1.8 (max 6.0) clipped to 1.0 at every step, update/weight 0.0025: "
        "healthy, a clip that acts is the script's design",
        lambda t: falls(t, 0.3) and statistics.median(norms(t, key="raw")) > 1.0,
        must_not=("exploding", "spike", "no_clipping")),
    "mingpt_blocks_unused": Case(
        "mingpt_sort.py", ("--bug", "blocks-unused"),
        "karpathy/minGPT@37baab71b9abea1b76ab957409a1cc2fbfba8a26 mingpt/model.py", "block outputs dropped",
        "all 24 tensors of transformer.h.0 and h.1 have no gradient at 60/60 steps (the blocks' outputs are "
        "discarded); the loss falls less (1.09 -> 0.65): never_learns naming transformer.h, first",
        lambda t: never(t, "transformer.h.", "absent") and len(rows(t)[0]["absent"]) == 24,
        rc=(0, 1), worst=("warning", "critical"), must={"never_learns": "warning"}, first="never_learns",
        names=(r"transformer\.h", r"(?i)modules run|computed and (then )?(dropped|not used)"),
        absent=(r"never uses them",)),
    # ---- vwxyzjn/cleanrl
    "ppo_healthy": Case(
        "cleanrl_ppo.py", (), "vwxyzjn/cleanrl@fe8d8a03c41a7ef5b523e2e354bd01c363e786bb cleanrl/ppo.py",
        "healthy (clip 0.5, annealed lr)",
        "loss 18 -> 18.4 (a value loss on returns that grow as episodes last longer), pre-clip norms ~8 under "
        "the 0.5 clip at every step, update/weight 3.6e-4: healthy, an RL loss that does not fall is no stall",
        lambda t: statistics.median(norms(t, key="raw")) > 0.5 and max(ratios(t)) < 0.002,
        must_not=("stall", "loss_diverging", "exploding", "no_clipping")),
    "ppo_reward_norm": Case(
        "cleanrl_ppo.py", ("--bug", "reward-norm"),
        "vwxyzjn/cleanrl@fe8d8a03c41a7ef5b523e2e354bd01c363e786bb cleanrl/ppo.py", "rewards standardised by std 0",
        "the loss and the gradients are NaN at step 1 (every reward 0/0) and the script then crashes on NaN "
        "logits: exit 3, the NaN loss at step 1 reported first as the cause",
        lambda t: math.isnan(losses(t)[0]) and rows(t)[0]["finite"] == 0,
        rc=3, worst=("critical", "critical"), must={"nonfinite_loss": "critical"}, first="nonfinite_loss",
        names=(r"step 1\b",)),
    "dqn_healthy": Case(
        "cleanrl_dqn.py", (), "vwxyzjn/cleanrl@fe8d8a03c41a7ef5b523e2e354bd01c363e786bb cleanrl/dqn.py",
        "healthy", "TD loss 1.03 -> 0.81, norm 2.2 -> 3.0 as the Q-values grow, update/weight 0.002: healthy",
        lambda t: falls(t, 0.05) and max(ratios(t)) < 0.01,
        must_not=("increasing", "loss_diverging", "exploding")),
    "dqn_lr": Case(
        "cleanrl_dqn.py", ("--learning-rate", "0.25"),
        "vwxyzjn/cleanrl@fe8d8a03c41a7ef5b523e2e354bd01c363e786bb cleanrl/dqn.py", "--learning-rate 0.25 (1000x)",
        "step 1's update is 2.4x the weights, the norm reaches 2048 at step 2 (800x the run's median 2.5) with "
        "a loss of 1842, then settles (last quarter 1.8 vs 1.0 at the start): the learning rate named as the "
        "cause of the blow-up",
        lambda t: ratios(t)[0] > 1 and max(norms(t)) > 500 * statistics.median(norms(t)),
        rc=(0, 1), worst=("warning", "critical"), must={"exploding|spike|loss_spike|loss_diverging": "warning"},
        names=(r"(?i)learning rate",), rows={"Update/weight ratio": "warning"}),
    # ---- huggingface/transformers examples (the accelerator's calls as plain torch)
    "glue_healthy": Case(
        "hf_glue_no_trainer.py", (),
        "huggingface/transformers@0310c247aafa21ef0567787645656d0ef1d42cf9 "
        "examples/pytorch/text-classification/run_glue_no_trainer.py", "healthy (BERT, AdamW groups, accumulation)",
        "two-micro-batch updates' loss 0.69 -> 0.62, norm ~0.27, update/weight 0.004, no clip (the source has "
        "none): healthy",
        lambda t: max(ratios(t)) < 0.02 and max(norms(t)) < 1,
        must_not=("stall", "no_clipping", "exploding")),
    "glue_frozen": Case(
        "hf_glue_no_trainer.py", ("--bug", "freeze-encoder"),
        "huggingface/transformers@0310c247aafa21ef0567787645656d0ef1d42cf9 "
        "examples/pytorch/text-classification/run_glue_no_trainer.py", "encoder frozen by a stray loop",
        "all 39 bert.* tensors are frozen (requires_grad=False, no gradient at 50/50 steps) yet in the "
        "optimizer; only the classifier trains and the loss stays at chance (0.69): the frozen encoder named as "
        "frozen, not as a part that fails to learn",
        lambda t: never(t, "bert.", "absent") and len(rows(t)[0]["absent"]) == 39,
        worst=("notice", "warning"), must_not=("never_learns", "zero_grads"),
        names=(r"\bbert\b", r"(?i)frozen|requires_grad")),
    "clm_healthy": Case(
        "hf_clm_no_trainer.py", (),
        "huggingface/transformers@00661e38a9e1393472adae9ac71f777b74ccdcde "
        "examples/pytorch/language-modeling/run_clm_no_trainer.py", "healthy (GPT-2, group_texts)",
        "two-micro-batch updates' loss 3.85 -> 3.60 (chance 3.87), norm ~1.2, update/weight 0.0026: healthy",
        lambda t: max(ratios(t)) < 0.01 and losses(t)[-1] < 3.7,
        must_not=("stall", "no_clipping", "exploding")),
    "clm_pad_lines": Case(
        "hf_clm_no_trainer.py", ("--bug", "pad-lines"),
        "huggingface/transformers@00661e38a9e1393472adae9ac71f777b74ccdcde "
        "examples/pytorch/language-modeling/run_clm_no_trainer.py", "a batch of empty lines (labels all -100)",
        "the loss is NaN at steps 7, 20 and 33 (a batch with no token to predict: 0/0) while every gradient is "
        "finite and the weights stay finite: the NaN loss named at step 7, not a NaN gradient or an explosion",
        lambda t: [i + 1 for i, x in enumerate(losses(t)) if math.isnan(x)] == [7, 20, 33] and finite_all(t),
        rc=(0, 1), worst=("warning", "critical"), must={"nonfinite_loss": "warning"}, first="nonfinite_loss",
        must_not=("exploding", "nonfinite_history", "nonfinite"), names=(r"step 7\b",)),
    # ---- huggingface/pytorch-image-models
    "timm_healthy": Case(
        "timm_train.py", (), "huggingface/pytorch-image-models@aa4b5850c1543fa488abf260f18390eda46cf85d train.py",
        "healthy (AMP GradScaler, unscale then clip)",
        "loss 1.49 -> 0.37, the 1.0 clip acts on the first steps only (max 1.48), no skipped step, "
        "update/weight 0.005: healthy",
        lambda t: falls(t, 0.5) and not any(r.get("skipped") for r in rows(t)),
        must_not=("amp_skipped", "exploding")),
    "timm_clip_before_unscale": Case(
        "timm_train.py", ("--bug", "clip-before-unscale"),
        "huggingface/pytorch-image-models@aa4b5850c1543fa488abf260f18390eda46cf85d timm/utils/cuda.py",
        "clip before scaler.unscale_",
        "the clip reads the scaled gradients (norm 9.6e4 = 65536 x 1.46) and bounds them to 1: the steps use "
        "norm 1.5e-5, update/weight 4e-6 (healthy 5e-3) and the loss never falls (1.49 -> 1.49): clip_scaled, "
        "critical, and the scaled norm is not an explosion",
        lambda t: not falls(t, 0.02) and max(ratios(t)) < 1e-5 and min(norms(t, key="raw")) > 5e4,
        rc=1, worst=("critical", "critical"), must={"clip_scaled": "critical"}, first="clip_scaled",
        must_not=("exploding",)),
    "timm_nan_image": Case(
        "timm_train.py", ("--bug", "nan-image"),
        "huggingface/pytorch-image-models@aa4b5850c1543fa488abf260f18390eda46cf85d train.py", "one NaN image",
        "the loss is NaN at update 12 (a corrupt image), the GradScaler skips that step, the weights stay finite "
        "and the loss falls as in the healthy run (1.49 -> 0.37): the NaN loss named at step 12, born in the "
        "input (BatchNorm's running statistics are NaN from then on: buffers_finite is false)",
        lambda t: [i + 1 for i, r in enumerate(rows(t)) if r.get("skipped")] == [12] and falls(t, 0.5)
        and t["buffers_finite"] is False,
        rc=(0, 1), worst=("warning", "critical"), must={"nonfinite_loss": "warning"}, first="nonfinite_loss",
        must_not=("exploding",), names=(r"step 12\b", r"(?i)input")),
    # ---- huggingface/diffusers
    "ddpm_healthy": Case(
        "diffusers_ddpm.py", (), DIFFUSERS, "healthy (epsilon MSE, clip 1.0)",
        "loss 1.15 -> 0.64, the clip acts early (max 2.8), update/weight 0.0023, learning rate 0 at step 1 "
        "(the warm-up starts at 0): healthy",
        lambda t: falls(t, 0.3) and rows(t)[0]["lr"] == 0,
        must_not=("lr_zero", "exploding")),
    "ddpm_clip_after_step": Case(
        "diffusers_ddpm.py", ("--bug", "clip-after-step"),
        DIFFUSERS, "clip after optimizer.step()",
        "the steps consume unclipped gradients (up to 2.8 where the script meant 1.0), the loss still falls "
        "(1.15 -> 0.67): clip_after_step, a warning",
        lambda t: max(norms(t)) > 2 and falls(t, 0.3),
        worst=("warning", "warning"), must={"clip_after_step": "warning"}, must_not=("exploding",)),
    # ---- tkipf/pygcn
    "gcn_healthy": Case(
        "pygcn_train.py", (), "tkipf/pygcn@1600b5b748b3976413d1e307540ccc62605b4d6d pygcn/train.py",
        "healthy (full batch, Adam)",
        "loss 1.48 -> 0.30, norm 0.40 -> 0.14, update/weight 0.04 (Adam lr 0.01 on small weights, the "
        "source's settings): healthy",
        lambda t: falls(t, 0.5)),
    "gcn_no_zero_grad": Case(
        "pygcn_train.py", ("--bug", "no-zero-grad"),
        "tkipf/pygcn@1600b5b748b3976413d1e307540ccc62605b4d6d pygcn/train.py", "zero_grad left out",
        "the gradient is the sum of every epoch's: norm 0.40 -> 8.6 rising linearly while the loss still falls "
        "(1.48 -> 0.33; Adam rescales): no_zero_grad first, the growth said to follow from it",
        lambda t: norms(t)[-1] > 15 * norms(t)[0] and falls(t, 0.5),
        rc=(0, 1), worst=("warning", "critical"), must={"no_zero_grad": "warning"}, first="no_zero_grad"),
    # ---- pytorch/tutorials
    "charrnn_healthy": Case(
        "char_rnn_classification.py", (),
        "pytorch/tutorials@016d0cc077f60c82b8497d4c7f92051ce40cafee "
        "intermediate_source/char_rnn_classification_tutorial.py", "healthy (hand SGD, lr 0.005, batch 1)",
        "one name per step: loss quarters 1.39 -> 1.34 (chance 1.39), norm ~1.6, all finite: healthy and "
        "slow, no warning",
        lambda t: falls(t, 0.02) and finite_all(t),
        must_not=("exploding", "loss_diverging"), absent=(r"param_groups",)),
    "charrnn_lr": Case(
        "char_rnn_classification.py", ("--learning_rate", "0.5"),
        "pytorch/tutorials@016d0cc077f60c82b8497d4c7f92051ce40cafee "
        "intermediate_source/char_rnn_classification_tutorial.py", "--learning_rate 0.5 (100x)",
        "norm 684 and loss 209 at step 10, 3.4e13 and 1.3e14 at step 11, NaN from step 12 to the end: critical, "
        "the blow-up first and the NaN after it; the fix uses the script's `learning_rate` (it has no optimizer)",
        lambda t: norms(t)[9] > 500 and math.isnan(losses(t)[11]) and math.isnan(losses(t)[-1]),
        rc=1, worst=("critical", "critical"), must={"nonfinite_loss|nonfinite_history": "critical"},
        first="exploding|loss_diverging", names=(r"\blearning_rate\b",), absent=(r"param_groups",)),
    # ---- Lightning-AI/pytorch-lightning
    "lightning_gan_healthy": Case(
        "lightning_gan.py", (), "Lightning-AI/pytorch-lightning@215acdc3efa4b096c80ab2d0263cab20d2f06f54 "
        "examples/pytorch/domain_templates/generative_adversarial_net.py", "healthy (manual optimization)",
        "D loss 0.70 -> 0.66, G loss 0.77 -> 0.75, ratios 2.6e-3 / 1.4e-3, norms steady: healthy",
        lambda t: falls(t, 0.03, "D") and max(ratios(t)) < 0.01),
    "lightning_gan_no_zero_grad_d": Case(
        "lightning_gan.py", ("--bug", "no-zero-grad-d"),
        "Lightning-AI/pytorch-lightning@215acdc3efa4b096c80ab2d0263cab20d2f06f54 "
        "examples/pytorch/domain_templates/generative_adversarial_net.py", "opt_d.zero_grad() left out",
        "the discriminator's gradient is the sum of all batches': D's norm 0.18 -> 5.1 rising linearly (G's "
        "steady) while both losses fall: no_zero_grad on the discriminator's optimizer, first",
        lambda t: norms(t, "D")[-1] > 20 * norms(t, "D")[0] and norms(t, "G")[-1] < 2 * norms(t, "G")[0],
        rc=(0, 1), worst=("warning", "critical"), must={"no_zero_grad": "warning"}, first="no_zero_grad",
        names=(r"opt_d|Adam #2|discriminator",)),
    # ---- facebookresearch/mixup-cifar10
    "mixup_healthy": Case(
        "mixup_cifar10.py", (), "facebookresearch/mixup-cifar10@1fe8c5edea624aa6733b0895d1a9b9c97d203c56 train.py",
        "healthy (SGD momentum, mixup)",
        "loss 2.31 -> 2.19 (mixup's soft targets; slow), norm 0.17 -> 0.5, update/weight 0.0075: healthy",
        lambda t: losses(t)[-1] < losses(t)[0] and max(ratios(t)) < 0.05,
        must_not=("exploding", "loss_diverging", "increasing")),
    "mixup_lr10": Case(
        "mixup_cifar10.py", ("--lr", "10"),
        "facebookresearch/mixup-cifar10@1fe8c5edea624aa6733b0895d1a9b9c97d203c56 train.py", "--lr 10 (100x)",
        "the update of step 3 moves the weights by 7x their size (a norm of 4.7 at lr 10), then the norm goes "
        "0.17 -> 3731 at step 7 -> 1.7e12 at step 8 (update 4.5e8x the weights), then every ReLU layer is dead "
        "(conv1 .. fc3 zero at 52/60 steps) and the loss stays above its start (3.4 vs 2.3): critical, the "
        "rewrite first (it came before the explosion, which follows it)",
        lambda t: max(norms(t)) > 1e9 and sum("conv1.weight" in r.get("zero", ()) for r in rows(t)) >= 50
        and next(i for i, x in enumerate(ratios(t)) if x >= 1) < next(i for i, x in enumerate(norms(t)) if x > 1e3),
        rc=1, worst=("critical", "critical"), must={"exploding": "critical", "update_rewrote": "warning"},
        first="update_rewrote",
        names=(r"\bconv1\b",), rows={"Update/weight ratio": "warning"}),
}
