"""The tuned lens (methods §17), trained from the model's own residual states: each step runs the
model forward without gradients over the next documents of the training task (its per-token
capture, :class:`~layerdiv.extract.text.TextCapture`, keeps h_0..h_(L-1) and h_L) and takes one
SGD step on the translators T_l(h) = h + W_l h + b_l, minimising KL(p_L || p_l^T) averaged over
the step's tokens and summed over blocks, p_l^T = softmax(W_U norm(T_l(h_l))) read out by the
model's own final norm and unembedding. Resumable from a checkpoint file; the seed fixes the
documents' order. :func:`lens_kl` scores a lens (logit or learned) on held-out documents."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from layerdiv.errors import LayerdivError
from layerdiv.extract.adapters import Adapter
from layerdiv.extract.forward import left_padded
from layerdiv.extract.models import LoadedModel
from layerdiv.extract.readout import Readout
from layerdiv.extract.text import TextCapture
from layerdiv.measurements.lens_stats import fit_ls, training_partition
from layerdiv.store.atomic import atomic_path
from layerdiv.store.translators import Translators, save_translators

MOMENTUM = 0.9
"""SGD's Nesterov momentum (the tuned-lens recipe)."""
LEARNING_RATE = 1.0 * (1 - MOMENTUM)
WEIGHT_DECAY = 1e-3
CLIP = 1.0
"""Gradients clipped at this norm (over every block's together)."""


class TunedLensError(LayerdivError, ValueError):
    """A tuned-lens fit that cannot start or resume."""


@dataclass(frozen=True)
class TunedSettings:
    """What a tuned-lens fit depends on (recorded in the translators' settings)."""

    steps: int = 100
    """Optimiser steps (the original: 250)."""
    tokens_per_step: int = 256
    """Tokens per step, whole documents taken in the seed's order until they reach it (the
    original: 2^18)."""
    seed: int = 0
    init: str = "zero"
    """``zero`` (W_l = 0, b_l = 0, the recipe's) or ``ls`` (the least-squares lens)."""


def step_documents(lengths: list[int], settings: TunedSettings) -> list[list[int]]:
    """The documents of each step: the task's documents in a seeded random order, taken in turn
    (again from the start when they run out) until a step holds ``tokens_per_step`` tokens."""
    order = list(range(len(lengths)))
    random.Random(settings.seed).shuffle(order)
    plan, k = [], 0
    for _ in range(settings.steps):
        docs, tokens = [], 0
        while tokens < settings.tokens_per_step:
            docs.append(order[k % len(order)])
            tokens += lengths[order[k % len(order)]]
            k += 1
        plan.append(docs)
    return plan


def residual_states(
    loaded: LoadedModel, capture: TextCapture, seqs: list[list[int]]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """h_0..h_(L-1) and h_L (float32, (tokens, d) each) at the documents' own tokens, from one
    forward pass without gradients."""
    inputs = {k: v.to(loaded.device) for k, v in left_padded(seqs, 0).items()}
    capture.reset(inputs["input_ids"])
    with torch.no_grad():
        loaded.model(**inputs, use_cache=False)
    *h, final = capture.states()
    width = final.shape[1]
    lengths = torch.as_tensor([len(s) for s in seqs], device=final.device)
    own = torch.arange(width, device=final.device)[None, :] >= (width - lengths[:, None])
    return [x[own] for x in h], final[own]


def _kl(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """(tokens,): KL(p || q) with log p = ``target`` and q = softmax(``logits``)."""
    return (target.exp() * (target - torch.log_softmax(logits, dim=-1))).sum(-1)


def _translate(h: torch.Tensor, W: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """T(h) = h + W h + b for rows h."""
    return h + h @ W.T + b


def train_tuned(
    loaded: LoadedModel,
    adapter: Adapter,
    seqs: list[list[int]],
    settings: TunedSettings,
    checkpoint: Path,
    init: tuple[np.ndarray, np.ndarray] | None = None,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """The tuned lens of ``loaded`` from documents ``seqs`` (token ids): A = I + W (L, d, d) and
    b (L, d), float32. ``init``: (A, b) to start from (the least-squares lens), else zero.
    ``checkpoint``: written every few steps and at the end, read back to resume a fit of the
    same settings (another's is refused)."""
    readout = Readout(loaded.model, adapter)
    capture = TextCapture(loaded.model, adapter, readout)
    try:
        return _train(loaded, capture, readout, seqs, settings, checkpoint, init, progress)
    finally:
        capture.remove()


def _train(
    loaded: LoadedModel,
    capture: TextCapture,
    readout: Readout,
    seqs: list[list[int]],
    settings: TunedSettings,
    checkpoint: Path,
    init: tuple[np.ndarray, np.ndarray] | None,
    progress: bool,
) -> tuple[np.ndarray, np.ndarray]:
    torch.manual_seed(settings.seed)
    plan = step_documents([len(s) for s in seqs], settings)
    h, final = residual_states(loaded, capture, [seqs[plan[0][0]]])
    blocks, d = len(h), final.shape[1]
    device = final.device
    W = torch.zeros(blocks, d, d, device=device)
    b = torch.zeros(blocks, d, device=device)
    if init is not None:
        W += torch.as_tensor(init[0], dtype=torch.float32, device=device) - torch.eye(
            d, device=device
        )
        b += torch.as_tensor(init[1], dtype=torch.float32, device=device)
    W.requires_grad_(True)
    b.requires_grad_(True)
    opt = torch.optim.SGD([W, b], lr=LEARNING_RATE, momentum=MOMENTUM, nesterov=True,
                          weight_decay=WEIGHT_DECAY)  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: max(0.0, 1 - t / settings.steps))
    start = _resume(checkpoint, settings, W, b, opt, sched)
    bar = tqdm(total=settings.steps, initial=start, desc="tuned lens", unit="step",
               disable=not progress, dynamic_ncols=True)  # fmt: skip
    with bar:
        for step in range(start, settings.steps):
            h, final = residual_states(loaded, capture, [seqs[i] for i in plan[step]])
            opt.zero_grad(set_to_none=True)
            total = 0.0
            with capture.pausing():  # readouts pass the final norm: its hook keeps nothing
                with torch.no_grad():
                    target = torch.log_softmax(readout.logits(final.to(capture.dtype)), dim=-1)
                for layer, x in enumerate(h):
                    out = _translate(x, W[layer], b[layer]).to(capture.dtype)
                    loss = _kl(target, readout.logits(out)).mean()
                    loss.backward()
                    total += float(loss.detach())
            torch.nn.utils.clip_grad_norm_([W, b], CLIP)
            opt.step()
            sched.step()
            bar.update(1)
            bar.set_postfix(kl=f"{total / blocks:.3f}")
            if (step + 1) % 10 == 0 or step + 1 == settings.steps:
                _save(checkpoint, settings, step + 1, W, b, opt, sched)
    eye = np.eye(d, dtype=np.float32)
    return W.detach().cpu().numpy() + eye, b.detach().cpu().numpy()


def _save(
    path: Path, settings: TunedSettings, step: int, W: torch.Tensor, b: torch.Tensor,
    opt: torch.optim.Optimizer, sched: Any,
) -> None:  # fmt: skip
    state = {
        "settings": asdict(settings),
        "step": step,
        "W": W.detach().cpu(),
        "b": b.detach().cpu(),
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(state, tmp)


def _resume(
    path: Path, settings: TunedSettings, W: torch.Tensor, b: torch.Tensor,
    opt: torch.optim.Optimizer, sched: Any,
) -> int:  # fmt: skip
    """The step a checkpoint at ``path`` reached (its state loaded), or 0 where there is none."""
    if not path.is_file():
        return 0
    state = torch.load(path, map_location=W.device, weights_only=True)
    if state["settings"] != asdict(settings) or state["W"].shape != W.shape:
        raise TunedLensError(
            f"{path} is the checkpoint of a tuned-lens fit with other settings "
            f"({state['settings']}); delete it, or fit with those settings"
        )
    with torch.no_grad():
        W.copy_(state["W"])
        b.copy_(state["b"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    return int(state["step"])


def lens_kl(
    loaded: LoadedModel,
    adapter: Adapter,
    seqs: list[list[int]],
    translators: tuple[np.ndarray, np.ndarray] | None = None,
    batch: int = 4,
) -> np.ndarray:
    """(L,) the mean over every token of ``seqs`` of KL(p_L || p_l) per block, p_l the logit
    lens's (``translators`` None) or the learned lens's with ``translators`` (A, b)."""
    readout = Readout(loaded.model, adapter)
    capture = TextCapture(loaded.model, adapter, readout)
    sums: np.ndarray | None = None
    n = 0
    affine = None
    if translators is not None:
        affine = [
            torch.as_tensor(t, dtype=torch.float32, device=loaded.device) for t in translators
        ]

    def transform(x: torch.Tensor, layer: int) -> torch.Tensor:
        return x if affine is None else x @ affine[0][layer].T + affine[1][layer]

    try:
        for k in range(0, len(seqs), batch):
            h, final = residual_states(loaded, capture, seqs[k : k + batch])
            with torch.no_grad(), capture.pausing():
                target = torch.log_softmax(readout.logits(final.to(capture.dtype)), dim=-1)
                kl = np.array([
                    float(_kl(target, readout.logits(transform(x, i).to(capture.dtype))).sum())
                    for i, x in enumerate(h)
                ])  # fmt: skip
            sums = kl if sums is None else sums + kl
            n += final.shape[0]
    finally:
        capture.remove()
    assert sums is not None
    return sums / n


STATES_SOURCE = "the model's own forward pass without gradients over the task's documents"
"""Where the tuned lens's residual states come from (recorded in its settings)."""


def fit_tuned(
    info: Any,
    model: str,
    settings: TunedSettings,
    out: Path,
    device: str = "auto",
    dtype: str = "auto",
    ridge: float | None = None,
    progress: bool = True,
) -> Translators:
    """The tuned translators of ``model`` trained on the documents of the text partition
    ``info`` (``layerdiv.store.PartitionInfo``: the documents it stores, as its extraction
    tokenized them), checkpointed beside ``out`` (``<out>.ckpt``, removed once done); ``--init
    ls`` starts from the least-squares lens of its stored sums (``ridge``). Refuses a model whose
    weights are not the partition's."""
    from layerdiv.extract.adapters import adapter_for
    from layerdiv.extract.models import (
        load_model,
        load_tokenizer,
        resolve_device,
        resolve_dtype,
        resolve_source,
    )
    from layerdiv.extract.plan import task_sequences

    training_partition(info)
    m = info.manifest
    init = fit_ls(info, ridge) if settings.init == "ls" else None
    source = resolve_source(model, m.revision, None, False)
    if source.weights_fingerprint != m.weights_fingerprint:
        raise TunedLensError(
            f"{info.where} was extracted from weights {m.weights_fingerprint[:12]}, not "
            f"{model}'s {source.weights_fingerprint[:12]}: fit a lens on a store of this model"
        )
    tokenizer = load_tokenizer(source)
    where = resolve_device(device)
    loaded = load_model(source, tokenizer, where, resolve_dtype(dtype, where))
    stored = [i for s, n in info.done for i in range(s, s + n)]
    every = task_sequences(info.task_argument, max(stored) + 1, tokenizer, loaded.context_length)
    seqs = [every[i] for i in stored]
    checkpoint = out.with_name(out.name + ".ckpt")
    A, b = train_tuned(loaded, adapter_for(loaded.model.config), seqs, settings, checkpoint,
                       None if init is None else (init.A, init.b), progress)  # fmt: skip
    recorded = {**asdict(settings), "states": STATES_SOURCE, "documents": len(seqs),
                "optimizer": f"SGD, Nesterov momentum {MOMENTUM}", "lr": LEARNING_RATE,
                "weight_decay": WEIGHT_DECAY, "clip": CLIP, "schedule": "linear decay to 0",
                "loss": "KL(p_L || p_l^T), mean over tokens, summed over blocks"}  # fmt: skip
    if init is not None:
        recorded["init_ridge"] = init.settings["ridge"]
    translators = Translators("tuned", A, b, m.weights_fingerprint, info.task, recorded)
    save_translators(out, translators)
    checkpoint.unlink(missing_ok=True)
    return translators


def fit_lens(
    info: Any,
    kind: str,
    model: str,
    out: Path,
    settings: TunedSettings | None = None,
    ridge: float | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> Translators:
    """The ``kind`` lens (``ls``: :func:`fit_ls` from the stored sums, no model; ``tuned``:
    :func:`fit_tuned` with ``settings``) of ``model`` fitted on the text partition ``info`` and
    written to ``out`` (``layerdiv fit-lens``, methods §17)."""
    if kind == "ls":
        translators = fit_ls(info, ridge)
        save_translators(out, translators)
        return translators
    return fit_tuned(info, model, settings or TunedSettings(), out, device, dtype, ridge)
