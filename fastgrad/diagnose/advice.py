"""Advice: what to do about the findings, generated after every rule has run, so that one cause's advice
never contradicts another's.

``advise(findings, ctx)`` returns ``(code, text, snippet)`` per finding code, most severe first. The text
and snippet of a code come from ``RUN_ADVICE`` (whole-run findings of ``python -m fastgrad.check``) or
``STEP_ADVICE`` (one step's report), fitted to what the script uses (``ctx``: a GradScaler, the module
types) and to the other findings (see ``_resolve``)."""

from __future__ import annotations

import re

from .finding import Finding, place_causes
from .thresholds import RANK

__all__ = ["STEP_ADVICE", "RUN_ADVICE", "advise", "reword_notices", "fit_names"]

# ---------------------------------------------------------------------------------------------- recommendations
STEP_ADVICE: dict[str, tuple[str, str]] = {
    "nonfinite": (
        "Find where the first non-finite value appears: check the loss before backward(), then the parameters. "
        "Under AMP, let the GradScaler skip the step (fastgrad.scaler_unscale_and_clip does the check fused).",
        "report = fastgrad.find_nonfinite(model, loss)   # after backward(); one sync\n"
        "print(report)  # loss finite?  which grads / params are NaN or Inf?\n"
        "# to locate the op that produced it, run the failing step's forward, loss and backward() under:\n"
        "with torch.autograd.detect_anomaly():\n"
        "    ...",
    ),
    "nonfinite_loss": (
        "The loss itself is NaN/Inf, so every update computed from it is garbage even where the gradients are "
        "finite. Check the loss before backward() and skip (or stop) the step; in a custom loss keep log, "
        "division and exp in range (add an eps, clamp); if the loss diverged first, lower the learning rate.",
        "# right after the loss is computed (one sync; fastgrad.GradientMonitor(model)(loss) flags it without one):\n"
        "if not torch.isfinite(loss):\n"
        "    raise FloatingPointError(f'non-finite loss {loss.item()}')\n"
        "# unstable pieces of a custom loss:\n"
        "loss = -torch.log(p.clamp_min(1e-8))         # log(0) = -inf\n"
        "ratio = a / (b + 1e-8)                       # x / 0\n"
        "z = torch.exp(s.clamp(max=80.0))             # exp overflows float32 above ~88\n"
        "for group in optimizer.param_groups:         # and if the loss diverged first\n"
        "    group['lr'] *= 0.1",
    ),
    "loss_spike": (
        "The loss jumped far above its recent level: an outlier batch, a too-high learning rate, or the start "
        "of a divergence. Clip the gradient norm, lower the learning rate, and check the batch of that step.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.5",
    ),
    "no_learning": (
        "Nothing will change at the next step. Check that the parameters require grad, that the loss depends "
        "on them (no .detach()/.item() in the graph), and look for dead units (e.g. ReLU layers with large "
        "negative biases).",
        "frozen = [n for n, p in model.named_parameters() if not p.requires_grad]\n"
        "unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]\n"
        "print('frozen:', frozen, 'unused:', unused)",
    ),
    "exploding": (
        "Clip the gradient norm before every optimizer step; if the norm stays above 1000, also lower the "
        "learning rate (and consider warmup).",
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "optimizer.step()\n"
        "# if the norm is still > 1000:\n"
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.1",
    ),
    "elevated": (
        "Above the usual healthy range: watch the trend (fastgrad.GradientMonitor); clipping at max_norm=1.0 is "
        "cheap insurance.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)",
    ),
    "low": (
        "Below the usual healthy range. Fine while the loss keeps decreasing; if it stalls, check the "
        "initialisation and the learning rate.",
        "",
    ),
    "vanishing": (
        "Check the architecture and the initialisation: saturating activations (sigmoid/tanh), missing "
        "normalisation or residual connections, a saturated output or a loss scaled down to nothing.",
        "for m in model.modules():\n"
        "    if isinstance(m, torch.nn.Linear):\n"
        "        torch.nn.init.kaiming_normal_(m.weight, nonlinearity='relu')\n"
        "# and prefer ReLU/GELU + LayerNorm/BatchNorm + residual connections in deep stacks",
    ),
    "clipped_to_zero": (
        "clip_grad_norm_ with max_norm=0 multiplies every gradient by 0, so nothing learns; the parameters are "
        "not frozen. Clip to a positive norm (1.0 is the usual start) or remove the clip.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)   # not max_norm=0",
    ),
    "mostly_zero": (
        "Most values of the dense gradients are exactly zero: units that never activate (dead ReLUs) or inputs "
        "that are mostly zero. Fine for sparse inputs; otherwise try LeakyReLU/GELU or a lower learning rate.",
        "",
    ),
    "small_but_learning": ("Small gradients while the loss is decreasing are fine: no action needed.", ""),
    "dead": (
        "Most gradient values are exactly zero: dead ReLUs (use LeakyReLU/GELU, a lower learning rate, a "
        "smaller negative bias) or parameters the loss does not reach.",
        "torch.nn.LeakyReLU(0.01)   # in place of each torch.nn.ReLU() of the model (F.leaky_relu for F.relu)",
    ),
    "depth_vanishing": (
        "The early layers barely learn: add residual connections and normalisation, use non-saturating "
        "activations, or give the early layers a higher learning rate.",
        "optimizer = torch.optim.AdamW([\n"
        "    {'params': early_layers.parameters(), 'lr': 10 * lr},\n"
        "    {'params': later_layers.parameters(), 'lr': lr},\n"
        "])",
    ),
    "spike": (
        "Isolated spikes usually come from outlier batches or a too-high learning rate: clip the norm.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)",
    ),
    "increasing": (
        "A steadily growing norm precedes divergence: lower the learning rate and clip the norm.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)",
    ),
    "nonfinite_seen": (
        "Some recent steps had NaN/Inf gradients. Under AMP with a GradScaler this is normal while the scale "
        "settles (those steps are skipped); otherwise locate the source.",
        "report = fastgrad.find_nonfinite(model, loss)   # right after the bad backward()\nprint(report)",
    ),
    "decaying": (
        "The gradient norm decays towards zero without the loss improving: training has stalled. Check the "
        "learning-rate schedule, saturation and dead units.",
        "",
    ),
}


# The fixes of the run-time red flags (text, code): the guide's advice, as code to paste.
RUN_ADVICE: dict[str, tuple[str, str]] = {
    "nonfinite_history": (
        "The optimizer stepped on NaN/Inf gradients, so the parameters are now garbage. Stop on the first "
        "non-finite step and find its source; under AMP let the GradScaler skip such steps.",
        "total = fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "if not torch.isfinite(total):             # one sync per step: use while debugging\n"
        "    print(fastgrad.find_nonfinite(model, loss)); break",
    ),
    "clip_scaled": (
        "Gradients were clipped while still multiplied by the GradScaler's scale, so max_norm acted on "
        "scale * grad: the real update was clipped to max_norm / scale. Unscale first (or use the fused call).",
        "scaler.scale(loss).backward()\n"
        "scaler.unscale_(optimizer)                                  # before clipping\n"
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "scaler.step(optimizer); scaler.update()\n"
        "# or, fused: fastgrad.scaler_unscale_and_clip(scaler, optimizer, 1.0)",
    ),
    "norm_miscounted": (
        "Count every element of the gradients once. DTensors (FSDP2, DTensor tensor parallelism): torch's or "
        "fastgrad's clip_grad_norm_ reads their placements. Plain tensors that several ranks hold whole (a tied "
        "embedding on the first and last pipeline stage, LayerNorms and biases that every tensor-parallel rank "
        "keeps, a shared expert): declare them with fastgrad.distributed.Copies so each counts once. Shards "
        "that other ranks hold: reduce over every rank holding a piece, not this rank's alone.",
        "from fastgrad.distributed import Copies\n"
        "# each tensor held whole on several ranks, with the ranks (or the process group) that hold it:\n"
        "copies = Copies(dist.group.WORLD, {tied_embedding: [0, last_stage_rank], layer_norm.weight: tp_group})\n"
        "total = fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0, process_group=copies)",
    ),
    "no_zero_grad": (
        "The gradients were never zeroed, so every step used the sum of all previous gradients. Zero them "
        "once per optimizer step (after the step, or before the backward of the next one).",
        "optimizer.step()\n"
        "optimizer.zero_grad(set_to_none=True)",
    ),
    "clip_after_step": (
        "Clipping after optimizer.step() changes nothing the optimizer used: the step was taken unclipped. "
        "Clip between backward() and step().",
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)   # before the step\n"
        "optimizer.step()\n"
        "optimizer.zero_grad(set_to_none=True)",
    ),
    "clip_not_params": (
        "A clip bounds the gradients of the tensors it is handed: hand it the parameters the step updates, "
        "between backward() and step(), not the loss.",
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)   # the parameters, not the loss\n"
        "optimizer.step()",
    ),
    "clip_partial": (
        "Clipping inside a gradient-accumulation window clips partial sums, and later micro-batches are added "
        "unclipped. Clip once, after the last micro-batch's backward, right before the step.",
        "# once per window, after the backward() of its last micro-batch:\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "optimizer.step()\n"
        "optimizer.zero_grad(set_to_none=True)",
    ),
    "no_clipping": (
        "The gradient norm exceeded 100 and nothing clips it. Clip before every optimizer step.",
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "optimizer.step()",
    ),
    "loss_diverging": (
        "The loss rose far above where it started and stayed up to the end of the run: the usual cause "
        "is a learning rate too high for this model. Lower it (10x), clip the gradient norm, and warm it up.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.1                      # first suspect: the learning rate\n"
        "loss.backward()\n"
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
        "optimizer.step()\n"
        "# and a warm-up over the first steps:\n"
        "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))",
    ),
    # the per-step report's code; the run-wide text names the learning rate first
    "exploding": (
        "Clip the gradient norm before every optimizer step; above 1000 the learning rate is the first suspect: "
        "lower it (and consider warmup).",
        STEP_ADVICE["exploding"][1],
    ),
    "exploding:loose_clip": (
        "The script clips, but at a bound above every norm this run reached, so the clip never acts. Lower "
        "max_norm into the healthy range (1.0 is the usual start); if the norm stays above 1000, lower the "
        "learning rate too.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)   # a bound the norm actually reaches",
    ),
    "exploding:clipped": (
        "The script's clip bounds every update, so the steps were not destroyed, but the raw gradients are out of "
        "range: the clip now decides every step and the gradient direction is all that is left. The cause is "
        "upstream: a learning rate too high (the first suspect: lower it), a loss summed instead of averaged, "
        "or unnormalised inputs or targets.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.1                      # first suspect: the learning rate",
    ),
    "exploding:overflow": (
        "The gradient norm overflowed float32: the gradients are so large (a norm above ~1.8e19) that clipping "
        "cannot rescue the step (the clip's coefficient becomes 0 and zeroes the update, or the update is "
        "applied unclipped). The learning rate is far too high for this model: lower it 10x or more and warm "
        "it up; under AMP also start the GradScaler at a smaller scale. Check the inputs and the loss scale of "
        "the first steps too.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.1                      # and again, until the norm stays finite\n"
        "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))\n"
        "# under AMP: scaler = torch.amp.GradScaler(init_scale=2.0**10)",
    ),
    # a NaN/Inf already in what the script fed its model: the data, not the model, the loss or the optimizer
    "nonfinite:input": (
        "The NaN/Inf was already in the model's input: fix the data (drop or impute missing values, guard "
        "normalisations against a zero std), or the op between module calls that made it. Nothing in the model, "
        "the loss or the learning rate is the cause.",
        "# x: one batch the script feeds its model (one sync: run it once on the data)\n"
        "bad = ~torch.isfinite(x).reshape(len(x), -1).all(1)\n"
        "print('samples with NaN/Inf:', bad.nonzero().flatten().tolist())\n"
        "x = torch.nan_to_num(x, nan=0.0)                    # or drop / impute them in the dataset",
    ),
    # one measured update moved the weights by their own size or more, and the next loss was NaN/Inf
    "nonfinite:learning_rate": (
        "One update moved the weights by more than their own size, so the next forward pass ran on weights far "
        "out of range and the loss overflowed: the learning rate is far too high for this model (the report "
        "quotes it and the update/weight ratio; about 1e-3 is typical). Lower it until the first updates stay "
        "well below the weights' size, and warm it up. Nothing in the loss's formula needs an eps or a clamp.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.01                     # the update was ~1x the weights: aim for ~1e-3\n"
        "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))",
    ),
    "loss_diverging:unrecovered": (
        "The loss jumped an order of magnitude and never got back to where it started: the run ends worse than "
        "it began. The usual cause is a learning rate too high for this model: lower it (10x), clip the "
        "gradient norm, and warm it up.",
        "",
    ),
    "loss_diverging:bootstrapped": (
        "A bootstrapped value or TD loss rises with the size of its targets: judge the run by its returns. If "
        "they fall too, lower the critic's learning rate or update the target network less often.",
        "",
    ),
    "zero_grads": (
        "Nothing this optimizer owns is learning. Check that its loss reaches its parameters (no .detach() or "
        "torch.no_grad() on the path, the right optimizer for the right network) and that they require grad.",
        "for n, p in model.named_parameters():\n"
        "    print(n, p.requires_grad, None if p.grad is None else float(p.grad.abs().max()))",
    ),
    "lr_schedule:negative": (
        "The learning-rate schedule drove the learning rate below 0, so the optimizer climbs the loss. Fix the "
        "schedule, not the learning rate: end a decay at its floor (clamp the factor at 0 or at a small minimum), "
        "make its length the number of times the scheduler is stepped, and print the learning rate after each "
        "scheduler.step() to see it.",
        "# a LambdaLR factor that cannot go below 0 (T: the number of scheduler.step() calls of the run)\n"
        "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: max(0.0, 1 - t / T))\n"
        "print([g['lr'] for g in optimizer.param_groups])   # after each scheduler.step()",
    ),
    "lr_schedule:collapse": (
        "The learning-rate schedule brought the learning rate to a vanishing share of its peak long before the "
        "run ended. Fix the schedule, not the learning rate: a schedule counted in epochs is stepped once per "
        "epoch (not per batch), and a decay factor per step is much closer to 1 than one per epoch. Print the "
        "learning rate after each scheduler.step() to see it.",
        "for epoch in range(epochs):\n"
        "    for batch in loader:\n"
        "        ...                                  # forward, backward, optimizer.step()\n"
        "    scheduler.step()                         # once per epoch, as the schedule counts\n"
        "print([g['lr'] for g in optimizer.param_groups])",
    ),
    "gradient_ascent:negated": (
        "The tensor handed to backward() is the loss function's value with its sign flipped, so each step climbs "
        "the loss. Backpropagate the loss as the loss function returns it (drop the minus sign, the negative "
        "factor or the 1 - loss); a quantity to maximise (a reward, a log-likelihood written by hand) is "
        "negated once, not a loss function's output.",
        "loss = criterion(model(x), y)              # as returned: no minus sign, no negative factor\n"
        "loss.backward()\n"
        "optimizer.step()",
    ),
    "gradient_ascent:maximize": (
        "The optimizer was built with maximize=True, which steps up the gradient, on a loss function's output, "
        "which is made to be minimised. Build it without maximize (the default is False).",
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)   # maximize=False: descend the loss",
    ),
    "probabilities_into_ce": (
        "F.cross_entropy and nn.CrossEntropyLoss apply log_softmax to their input themselves: hand them the "
        "model's logits (its output before any softmax) and keep the softmax for predictions. A model that must "
        "output probabilities trains with F.nll_loss on their log instead.",
        "logits = model(x)                          # no softmax before the loss (drop a final nn.Softmax)\n"
        "loss = F.cross_entropy(logits, y)          # it applies log_softmax itself\n"
        "probs = torch.softmax(logits, dim=1)       # for predictions only\n"
        "# or, where the model outputs probabilities:\n"
        "# loss = F.nll_loss(torch.log(probs.clamp_min(1e-12)), y)",
    ),
    "accum_not_divided": (
        "Divide each micro-batch's loss by the number of backward calls per optimizer step, so that the step's "
        "gradient is the window's mean (what one large batch gives) and the learning rate means the same "
        "whatever the window. Keep the sum only if the learning rate was tuned for it.",
        "loss = loss / WINDOW                       # the backward calls per optimizer.step()\n"
        "loss.backward()",
    ),
    "weight_decay_drag": (
        "Lower the weight decay until lr x weight_decay is about 1e-4 a step or less (AdamW: weight_decay 0.01 to "
        "0.1 at lr 1e-3; SGD: 1e-4 to 5e-4 at lr 0.1), so that the gradient, not the decay, sets the weights.",
        "for group in optimizer.param_groups:\n"
        "    group['weight_decay'] = DECAY             # lr x weight_decay about 1e-4 a step",
    ),
    "saturated_at_init": (
        "Initialise each layer for the activation after it, so that its outputs start in range: Xavier/Glorot "
        "with the activation's gain (std about 1/sqrt(fan_in) for tanh), and normalise the inputs (zero mean, unit "
        "variance); a LayerNorm before the activation keeps it in range as the weights grow.",
        "for m in model.modules():\n"
        "    if isinstance(m, nn.Linear):\n"
        "        nn.init.xavier_uniform_(m.weight, gain=nn.init.calculate_gain('tanh'))\n"
        "        nn.init.zeros_(m.bias)",
    ),
    "update_rewrote": (
        "An update as large as the weights replaces them: lower the learning rate until the update/weight ratio "
        "of the first steps stays well below 1 (about 1e-3 is typical), and warm it up over the first steps.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.1                      # then watch the update/weight ratio (~1e-3)\n"
        "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))",
    ),
    "nonfinite_buffers": (
        "Keep a bad batch out of the buffers as well as the weights: a fastgrad.StepGuard given the model puts "
        "every buffer the forward updated back on a step it skips (a GradScaler skips only the optimizer's step). "
        "Fix the batch itself too (the NaN/Inf finding says where it came from). The buffers are NaN now: reset "
        "them and let a few clean batches in training mode re-estimate them, or reload a checkpoint from before.",
        "guard = fastgrad.StepGuard(optimizer, max_norm=1.0, model=model)   # built once, after the optimizer\n"
        "# each step, between backward() and optimizer.step() (under a GradScaler: guard.clip_(scaler)):\n"
        "guard.clip_()\n"
        "# a model whose running statistics are already NaN: start them again\n"
        "for m in model.modules():\n"
        "    if hasattr(m, 'reset_running_stats'):\n"
        "        m.reset_running_stats()",
    ),
    "nonfinite_buffers:guard": (
        "Give the step guard the model: with model=, a step it skips also leaves every buffer as it was (a "
        "snapshot before the forward, restored on the device by the skip flag, no host sync). The buffers are NaN "
        "now: reset them and let a few clean batches in training mode re-estimate them, or reload a checkpoint "
        "from before.",
        "guard = fastgrad.StepGuard(optimizer, max_norm=1.0, model=model)   # the script's guard, with model= added\n"
        "# a model whose running statistics are already NaN: start them again\n"
        "for m in model.modules():\n"
        "    if hasattr(m, 'reset_running_stats'):\n"
        "        m.reset_running_stats()",
    ),
    "frozen_in_optimizer": (
        "Decide whether these tensors should learn. If the freeze is deliberate, give the optimizer only the "
        "trainable parameters (it then holds no state for the frozen ones); if not, remove the "
        "requires_grad_(False).",
        "print([n for n, p in model.named_parameters() if not p.requires_grad])   # the frozen tensors\n"
        "trainable = [p for p in model.parameters() if p.requires_grad]   # a deliberate freeze: only these\n"
        "# go where the optimizer is built (its other arguments as before)",
    ),
    "never_learns:invariant": (
        "Nothing to fix: the loss does not depend on these tensors, so their gradient is zero by construction. "
        "Leave them, or drop them from the model (bias=False) to save the optimizer's state.",
        "",
    ),
    "lr_zero": (
        "Give the optimizer a nonzero learning rate (print optimizer.param_groups[0]['lr'] where it is built and "
        "after each scheduler.step()).",
        "print([g['lr'] for g in optimizer.param_groups])   # where the optimizer is made, and after scheduler.step()",
    ),
    "clip_zeroes": (
        "A clip bound of 0 scales every gradient to zero, so nothing learns. Clip at a positive bound (1.0 is the "
        "usual start), or drop the clip.",
        "fastgrad.clip_grad_norm_(model.parameters(), max_norm=1.0)   # not max_norm=0",
    ),
    "stall": (
        "The loss has not improved beyond its own step-to-step noise. If the learning rate is tiny (an "
        "update/weight ratio far below ~1e-3), "
        "raise it; if it is large, the optimizer may be bouncing across a valley: lower it. At chance level, "
        "also check that the labels match the inputs (a shuffled or constant target) and that the model's "
        "output reaches the loss.",
        "print([g['lr'] for g in optimizer.param_groups])   # and the update/weight ratio in this report\n"
        "# can the model overfit one fixed batch? Repeat the script's own step on one batch ~200 times: if the\n"
        "# loss does not fall, the setup (labels, loss, what reaches the loss) is wrong",
    ),
    "update_tiny": (
        "This optimizer's updates are a vanishing share of its weights (see the update/weight ratio): its learning "
        "rate is too small to move them. Raise it until the ratio approaches ~1e-3.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 100                      # then watch the update/weight ratio (~1e-3)",
    ),
    "stall:tiny_update": (
        "The updates are a vanishing share of the weights (see the update/weight ratio): the learning rate is too "
        "small to move them. Raise it until the ratio approaches ~1e-3.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 100                      # then watch the update/weight ratio (~1e-3)",
    ),
    "stall:large_update": (
        "Each update is a large share of the weights and the loss does not improve: the optimizer steps across "
        "the minimum and back. Lower the learning rate until the update/weight ratio is nearer ~1e-3.",
        "for group in optimizer.param_groups:\n"
        "    group['lr'] *= 0.1                      # then watch the update/weight ratio (~1e-3)",
    ),
    # the guide's limit alone, with no harm seen: a question, not a reason to change the learning rate
    "exploding:no_harm": (
        "The norm is above the guide's range, but the run shows no harm from it (the evidence is in the finding). "
        "Check whether it is the loss's own scale: a loss summed over the batch (reduction='sum', a VAE's "
        "reconstruction term) or over an episode has gradients that grow with the batch or the episode. Nothing "
        "to change while the loss keeps falling; to compare with the guide's ranges, divide the loss by the batch "
        "size. A clip, if you want one, belongs at a bound near the run's own level, not at 1.0.", ""),
    # one norm far above the run's own level, and nothing after it: an outlier batch the step absorbed
    "exploding:no_damage": (
        "One step's norm was far above the run's own level, and the run shows no damage after it (the loss did "
        "not jump, nothing went NaN/Inf, no measured update rewrote the weights): an outlier batch that the "
        "optimizer absorbed. Nothing to change while that holds; a clip at a bound a few times the run's own level "
        "keeps a larger one from landing in full.", ""),
    # a batch whose loss and gradient jumped together, within 10x of the run's own level, and nothing after it
    "exploding:hard_batch": (
        "One batch's loss and gradient jumped together (the loss of that step itself, before its update), and the "
        "run shows no damage after it: the next loss did not jump, nothing went NaN/Inf, no measured update "
        "rewrote the weights. A hard batch or state (a rare transition in a replay buffer, a long sequence): "
        "nothing to change while that holds; a clip at a bound a few times the run's own level keeps a harder one "
        "from landing in full.", ""),
    "increasing:no_harm": (
        "The norm rises while the run shows no harm from it: no action needed while that holds. If the loss "
        "starts to rise or an update nears the size of the weights, lower the learning rate then.", ""),
    "vanishing:no_harm": (
        "The norm is below the guide's range, but the run does not show the loss stalled: small gradients are fine "
        "while the loss falls (a model near convergence, a loss with a small scale). If it stops improving, check "
        "the initialisation and the learning rate.", ""),
    "no_clipping:no_harm": (
        "Nothing clips the gradients; the run shows no damage from its norm, so no clip is needed for it.", ""),
    "never_learns": (
        "Find why no gradient reaches these tensors: print their gradient after one backward(). A ReLU that never "
        "fires (a large negative bias, unnormalised inputs) passes nothing back: fix its initialisation or inputs; "
        "an op whose derivative is 0 (round, sign, argmax, a comparison) cuts the graph: use a differentiable "
        "stand-in (e.g. a straight-through estimator).",
        "for n, p in model.named_parameters():\n"
        "    if p.requires_grad:\n"
        "        print(n, None if p.grad is None else float(p.grad.abs().max()))   # after one backward()"),
    "never_learns:cut": (
        "The modules that own these tensors run in forward(), but no gradient comes back to them: their output "
        "leaves the graph on its way to the loss. Look on that path for a .detach(), .data, a torch.no_grad() block "
        "or a value rebuilt from .item()/.numpy(), or for an output computed and not used (block(x) instead of "
        "x = block(x)), and fix it if they are meant to learn; if not, freeze them (requires_grad_(False)) or leave "
        "them out of the optimizer.", ""),
    "never_learns:reverse_last_step": (
        "Read the reverse direction where it has seen the whole sequence: at the first time step, or from the "
        "final hidden state h_n (its last two rows for the top layer of a one-direction-per-row stack). The "
        "forward half at the last step and the reverse half at the first step together summarise the sequence.",
        "out, h = model.RNN(x)   # where forward() runs it; h is (h_n, c_n) for an LSTM\n"
        "h_n = h[0] if isinstance(h, tuple) else h\n"
        "summary = torch.cat([h_n[-2], h_n[-1]], dim=1)   # forward and reverse, each after the whole sequence"),
    "never_learns:unused": (
        "These tensors are never in the loss's graph: if they are meant to learn, call the module that owns them "
        "in forward(); if not, freeze them (requires_grad_(False)) or leave them out of the optimizer.", ""),
    "depth_vanishing:recurrent": (
        "The first layers of the recurrent stack barely learn: a stack of plain nn.RNN layers contracts the "
        "gradient layer by layer. Use an LSTM or GRU, fewer layers, or residual connections between layers (and "
        "an initialisation that does not shrink the weights); a higher learning rate for the first layers only "
        "treats the symptom.", ""),
    "depth_vanishing:normalised": (
        "The model already normalises its layers, yet the first layers barely learn. A normalisation after each "
        "residual sum (post-norm, as in the original Transformer) shrinks the gradient that reaches the first "
        "layers with depth, and more so under a large learning rate in the first steps: warm the learning rate "
        "up (or lower it), or normalise each block's input instead (pre-norm). A higher learning rate for the "
        "first layers only treats the symptom.",
        "scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))\n"
        "scheduler.step()   # after each optimizer.step(): the lr rises to its value over 100 steps"),
    "decaying:converging": (
        "The gradient norm decays while the loss keeps improving: usual near convergence, no action needed. If "
        "it keeps falling after the loss flattens, check the learning-rate schedule.", ""),
    "not_checked": ("Nothing was checked: make the script take at least one optimizer step (or one scalar "
                    "backward()) under the checker, e.g. with fewer epochs or --steps.", ""),
    "amp_skipped": ("Skipped steps are how a GradScaler handles fp16 overflow; worry only if they keep coming.",
                    ""),
    "script_crashed": ("The script raised before finishing; the report covers the steps that ran.", ""),
}


# every finding of the rule has a variant; the plain code (the reference's table) reads as the collapse
RUN_ADVICE["lr_schedule"] = RUN_ADVICE["lr_schedule:collapse"]
RUN_ADVICE["gradient_ascent"] = RUN_ADVICE["gradient_ascent:negated"]
# same fix as a divergence: the same code
RUN_ADVICE["loss_diverging:unrecovered"] = (RUN_ADVICE["loss_diverging:unrecovered"][0],
                                            RUN_ADVICE["loss_diverging"][1])

_RELU_FAMILY = {"ReLU", "ReLU6", "RReLU", "Hardtanh", "Threshold"}
_RECURRENT = {"LSTM", "GRU", "RNN", "LSTMCell", "GRUCell", "RNNCell"}
_NORMALISED = {"LayerNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm"}


# Findings that mean the run is diverging (or already broken): while one is present, no advice may suggest
# a higher learning rate, and "small gradient" advice is not about the cause.
_DIVERGING = {"nonfinite", "nonfinite_history", "nonfinite_loss"}
# Advice that would raise a learning rate or treat small gradients as the problem.
_SMALL_GRADIENT = {"depth_vanishing", "vanishing", "low", "decaying"}


def _diverging(findings: list[Finding]) -> Finding | None:
    for f in findings:
        if f.code in _DIVERGING or (f.code in ("exploding", "loss_diverging") and f.severity != "notice"
                                    and f.evidence.get("variant") != "bootstrapped"):
            if f.code == "exploding" and f.severity != "critical":
                continue
            return f
    return None


def advise(findings: list[Finding], ctx: dict | None = None, *, run: bool = True) -> list[tuple[str, str, str]]:
    """(code, text, snippet) per finding code, most severe first, fitted to what the script uses (the clip
    snippets unscale first under a GradScaler; no LeakyReLU advice for a model without ReLUs) and to the
    other findings: while the run diverges (a rising ``loss_diverging``, a critical ``exploding`` or a
    non-finite finding), the advice of the small-gradient findings (``depth_vanishing``, ``vanishing``,
    ``low``, ``decaying``) says to fix the divergence first and never to raise a learning rate; in a run with
    a warning or a critical finding, a notice's "no action needed" advice is left out (it would read as a
    verdict). ``run``: the whole-run advice table first (``python -m fastgrad.check``), else the step
    report's only."""
    ctx = ctx or {}
    ordered = place_causes(sorted(findings, key=lambda f: -RANK[f.severity]))
    worst = ordered[0].severity if ordered else "healthy"
    cause = _diverging(ordered)
    seen, out = set(), []
    for f in ordered:
        if f.code in seen:
            continue
        seen.add(f.code)
        variant = f"{f.code}:{f.evidence.get('variant')}" if f.evidence.get("variant") else None
        if f.code in _DIVERGING and f.evidence.get("variant") == "learning_rate":
            # one update threw the weights out of range: every NaN finding has that cause, said once
            if "nonfinite:learning_rate" in seen:
                continue
            seen.add("nonfinite:learning_rate")
            variant = "nonfinite:learning_rate"
        elif f.code in _DIVERGING and f.evidence.get("born_in") == "input":
            # every NaN finding of the run has the same cause: say it once
            if "nonfinite:input" in seen:
                continue
            seen.add("nonfinite:input")
            variant = "nonfinite:input"
        loose = f.evidence.get("variant") == "loose_clip"
        if run and f.severity == "notice" and f.evidence.get("harm") == [] and f"{f.code}:no_harm" in RUN_ADVICE:
            variant = f"{f.code}:no_harm"
        elif run and f.code == "never_learns" and not f.evidence.get("zero") and not f.evidence.get("invariant"):
            variant = "never_learns:cut" if f.evidence.get("cut") else "never_learns:unused"
        elif f.code == "depth_vanishing" and set(ctx.get("modules", ())) & _RECURRENT and not (
                set(ctx.get("modules", ())) & _RELU_FAMILY):
            variant = "depth_vanishing:recurrent"
        elif f.code == "depth_vanishing" and set(ctx.get("modules", ())) & _NORMALISED:
            # the usual fix (add normalisation) is already there: the stack's depth and the lr's first steps
            variant = "depth_vanishing:normalised"
        text, snippet = ((RUN_ADVICE.get(variant) or RUN_ADVICE.get(f.code) if run else None)
                         or STEP_ADVICE.get(variant) or STEP_ADVICE.get(f.code) or ("", ""))
        if loose and variant == "exploding:no_harm" and f.evidence.get("max_norm") is not None:
            text += (f" The script's clip (max_norm={f.evidence['max_norm']:g}) is above every norm of the run: it "
                     "never acts.")
        if f.code == "clip_not_params" and f.evidence.get("max_norm") is not None:  # the script's own bound
            snippet = snippet.replace("max_norm=1.0", f"max_norm={f.evidence['max_norm']:g}")
        if f.code == "accum_not_divided":  # the run's own window, in the line to add
            snippet = snippet.replace("WINDOW", str(f.evidence.get("window", "accum_steps")))
        if f.code == "weight_decay_drag" and f.evidence.get("pull"):  # 1e-4 a step at the run's own lr
            snippet = snippet.replace("DECAY", f"{1e-4 * f.evidence['weight_decay'] / f.evidence['pull']:.3g}")
        if variant == "never_learns:reverse_last_step" and f.evidence.get("zero"):
            # the module as the model names it ("Class:" marks a second model's tensors)
            name = f.evidence["zero"][0].split(":")[-1]
            snippet = snippet.replace("model.RNN", "model." + name.rsplit(".", 1)[0] if "." in name else "model")
        if f.code == "depth_vanishing" and f.evidence.get("units") and variant is None:
            snippet = _depth_snippet(f.evidence["units"], f.layers, (ctx.get("names") or {}).get("manual"))
        if f.evidence.get("follows"):
            # the cause's advice is the fix: this one says so instead of adding its own
            text = (f"This follows from `{f.evidence['follows']}` (above): fix that first; look at this again on "
                    "the next run.")
            snippet = ""
        elif cause is not None and f.code in _SMALL_GRADIENT:
            text = (f"Small gradients are not the problem while the run diverges ({cause.code}): fix that first, "
                    "and do not raise any learning rate while it does. Look at this again once the loss falls.")
            snippet = ""
        elif RANK[worst] >= RANK["warning"] and f.severity == "notice" and f.code in _NO_ACTION:
            continue
        if variant == "never_learns:cut" and f.evidence.get("unused"):  # both kinds: both fixes
            text += " For the tensors never used: " + RUN_ADVICE["never_learns:unused"][0]
        if f.code == "never_learns" and f.evidence.get("zero") and set(ctx.get("modules", ())) & _RELU_FAMILY:
            text += (" In a model with ReLUs, a unit that is off for every input stays off: LeakyReLU(0.01) or GELU "
                     "keeps a gradient flowing.")
        if f.code == "mostly_zero" and not (set(ctx.get("modules", ())) & _RELU_FAMILY):
            text = text.replace("units that never activate (dead ReLUs) or inputs", "inputs").replace(
                "; otherwise try LeakyReLU/GELU or a lower learning rate", "; otherwise look for parameters the loss "
                "does not reach, or saturated gates (sigmoid/tanh at their limits)")
        if f.code == "dead" and not (set(ctx.get("modules", ())) & _RELU_FAMILY):
            rec = sorted(set(ctx.get("modules", ())) & _RECURRENT)
            text = ("Most gradient values are exactly zero and the model has no ReLU units"
                    + (f" (it uses {', '.join(rec)})" if rec else "")
                    + ": look for parameters the loss does not reach (unused embedding rows or heads, a "
                      "detached branch) or saturated gates (sigmoid/tanh at their limits).")
            snippet = ("unused = [n for n, p in model.named_parameters()\n"
                       "          if p.grad is not None and (p.grad == 0).float().mean() > 0.5]\n"
                       "print('mostly-zero gradients:', unused)")
        if ctx.get("clip") and f.code in _ADDS_A_CLIP and f.evidence.get("variant") not in _READ_THE_CLIP:
            text, snippet = _fit_clip(text, snippet, ctx["clip"])
        if ctx.get("scaler") and "clip_grad_norm_(" in snippet and "unscale_" not in snippet:
            # under a GradScaler the gradients must be unscaled before the clip (or use the fused call)
            snippet = snippet.replace("loss.backward()\n", "scaler.scale(loss).backward()\n")
            snippet = _indent_replace(snippet)
            snippet = snippet.replace("optimizer.step()", "scaler.step(optimizer); scaler.update()")
        if text:
            out.append((f.code, text, fit_names(snippet, _owner_names(ctx.get("names") or {}, f),
                                                f.evidence.get("series"))))
    return out


def _depth_snippet(units: dict, layers: list[str], manual: bool) -> str:
    """A higher learning rate for the layers that barely learn, named as the model names them (in a loop
    without torch.optim: in the script's own update)."""
    names = [n for u in layers for n in units.get(u, ())]
    early = ("early = {" + ", ".join(repr(n) for n in names) + "}   # the parameters of "
             + ", ".join(layers) + "\n")
    if manual:
        return early + ("for n, p in model.named_parameters():   # the update, 10x for the early layers\n"
                        "    p.data.add_(p.grad, alpha=-(10 * lr if n in early else lr))")
    return early + ("lr = optimizer.param_groups[0]['lr']\n"
                    "groups = [{'params': [p for n, p in model.named_parameters() if n in early], 'lr': 10 * lr},\n"
                    "          {'params': [p for n, p in model.named_parameters() if n not in early], 'lr': lr}]\n"
                    "optimizer = type(optimizer)(groups)   # where the script builds its optimizer")


# ---------------------------------------------------------------------------------------------- the script's names
_PARAM_GROUPS_LR = re.compile(r"for group in optimizer\.param_groups:([^\n]*)\n(\s*)group\['lr'\] \*= ([0-9.e+-]+)"
                              r"([^\n]*)")


def _owner_names(names: dict, f: Finding) -> dict:
    """``names`` with ``model`` the script's variable for the model whose tensors the finding names (their
    names' prefix: the first model bare, a later one "Class:"), where the run knows it."""
    models = names.get("models") or {}
    if not f.layers or not models:
        return names
    layer = f.layers[0]
    pre = layer.split(":", 1)[0] + ":" if ":" in layer else ""
    var = models.get(pre)
    return dict(names, model=var) if var else names


def fit_names(snippet: str, names: dict, series: int | None = None) -> str:
    """``snippet`` in the script's own names (``names``: ``optimizer`` and ``scheduler``, lists of each series'
    variable or None, ``model``, ``lr`` and ``manual``, from the run): its optimizer variable for ``optimizer``,
    its scheduler's for ``scheduler``, its model's for ``model``; in a loop without torch.optim (``manual``), its
    own learning-rate variable instead of the optimizer's param groups, and its own update instead of
    ``optimizer.step()``."""
    if not snippet or not names:
        return snippet
    if names.get("manual"):
        snippet = _manual(snippet, names.get("lr"))
    else:
        opts = names.get("optimizer") or []
        var = opts[series] if series is not None and series < len(opts) and opts[series] else next(
            (v for v in opts if v), None)
        if var and var != "optimizer":
            snippet = re.sub(r"\boptimizer\b", var, snippet)
        scheds = names.get("scheduler") or []
        sched = scheds[series] if series is not None and series < len(scheds) else next(
            (v for v in scheds if v), None)
        if sched and sched != "scheduler":  # ``lr_scheduler`` (the torch module) is not a match
            snippet = re.sub(r"(?<![.\w])scheduler\b", sched, snippet)
    model = names.get("model")
    if model and model != "model":
        snippet = re.sub(r"(?<![.\w])model\b(?!')", model, snippet)
    return snippet


def _manual(snippet: str, lr: str | None) -> str:
    """A snippet for a loop that updates ``p.data`` by hand: no optimizer exists, its learning rate is ``lr``."""
    var = lr or "lr"

    def scale(m):  # the script's variable, or in words when it is not known; the loop line's comment kept
        how = f"{var} *= {m.group(3)}" if lr else f"# multiply the learning rate of the update by {m.group(3)}"
        return how + (m.group(4) if m.group(4).strip() else m.group(1))
    snippet = _PARAM_GROUPS_LR.sub(scale, snippet)
    if lr and lr != "lr":
        snippet = re.sub(r"\blr\b(?!')", lr, snippet)
    out = []
    for line in snippet.split("\n"):
        code = line.split("#")[0]
        if "optimizer" not in code:
            out.append(line)
        elif "LambdaLR" in code:
            out.append(f"# a warm-up: scale {var} by min(1.0, (step + 1) / 100) over the first 100 steps")
        elif "ReduceLROnPlateau" in code:
            out.append(f"# and lower {var} when the loss stops falling")
        elif "param_groups" in code and "print" in code:
            out.append(f"print({var})   # the learning rate of the update" if lr else
                       "# print the learning rate the update uses")
        elif ".zero_grad(" in code:
            out.append(line[:len(line) - len(line.lstrip())] + "model.zero_grad(set_to_none=True)")
        elif ".step()" in code:
            out.append(line[:len(line) - len(line.lstrip())] + "for p in model.parameters():   # the script's update")
            out.append(line[:len(line) - len(line.lstrip())] + f"    p.data.add_(p.grad, alpha=-{var})")
        else:  # a line only an optimizer can run: the script has none
            out.append("# (a line for a torch.optim optimizer: the script updates its parameters by hand)")
    return "\n".join(out)


# Advice that would add a norm clip: where the script already clips, it says so instead (its bound, and whether
# the clip acted), and the code to add keeps everything but the clip.
#: exploding's variants that already describe the script's clip (bounded the update, never acted, overflowed)
_READ_THE_CLIP = {"clipped", "loose_clip", "overflow"}
_ADDS_A_CLIP = {"exploding", "elevated", "spike", "increasing", "loss_spike", "loss_diverging"}
_CLIP_PHRASES = (
    ("Clip the gradient norm before every optimizer step; above", "Above"),
    ("Clip the gradient norm before every optimizer step; if", "If"),
    (", clip the gradient norm, and warm it up", " and warm it up"),
    (": clip the norm.", "."), (" and clip the norm.", "."),
    ("Clip the gradient norm, lower the learning rate,", "Lower the learning rate,"),
    ("; clipping at max_norm=1.0 is cheap insurance.", "."),
)


def _fit_clip(text: str, snippet: str, clip: dict) -> tuple[str, str]:
    for old, new in _CLIP_PHRASES:
        text = text.replace(old, new)
    bound = f"max_norm={clip['bound']:g}" if clip.get("bound") is not None else "its own bound"
    acted = (f"it acted at {clip['acted']} of the {clip['read']} step(s) whose norm it returned" if clip["read"]
             else "whether it acted is not known (its norm was not readable)")
    text += f" The script already clips ({bound}, at {clip['steps']} of {clip['of']} step(s)); {acted}."
    # the clip line goes, and the backward/step lines that only placed it
    lines = [ln for ln in snippet.split("\n")
             if "clip_grad_norm_(" not in ln and ln.strip() not in ("loss.backward()", "optimizer.step()")]
    return text, "\n".join(lines).strip("\n")


def reword_notices(findings: list[Finding]) -> None:
    """In a run with a warning or a critical finding, a notice's "no action needed" is about that notice
    alone: say so (in place), so it does not read as the run's verdict."""
    if not any(RANK[f.severity] >= RANK["warning"] for f in findings):
        return
    for f in findings:
        if f.severity == "notice" and "no action needed" in f.detail and "by itself" not in f.detail:
            f.detail = f.detail.replace("no action needed", "no action needed by itself (see the findings above)")


# notices whose advice is "nothing to do": left out when a warning or critical finding is present
_NO_ACTION = {"small_but_learning", "increasing", "amp_skipped", "decaying"}


def _indent_replace(snippet: str) -> str:
    lines = []
    for line in snippet.split("\n"):
        if "clip_grad_norm_(" in line:
            pad = line[:len(line) - len(line.lstrip())]
            lines.append(pad + "scaler.unscale_(optimizer)   # the GradScaler's gradients are scaled: unscale first")
        lines.append(line)
    return "\n".join(lines)

