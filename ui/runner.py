"""Start generations: settings -> model pair -> prompt ids -> engine iterator."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

from collections.abc import Mapping

from dyntree_core.config import ConfigError, DecodeConfig
from dyntree_core.decode.engine import SpeculativeDecoder
from dyntree_core.planning.machine_profile import pair_name_of
from dyntree_core.planning.peer_prices import load_peer_ratios, peer_sentence, price_peers, record_peer_ratio
from dyntree_core.planning.prediction import Prediction
from dyntree_core.planning.profiling import run_probe

from .models import ModelProvider
from .prompt_check import TextInfo, check_prompt, fit_prompt
from .session import ExternalRun, Generation, RoundPoint, RunRecord
from .settings import AUTO, RunSettings
from .tokens import TokenTexts


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Prompt text -> token ids, optionally through the tokenizer's chat template.

    (transformers 5 returns a ``BatchEncoding`` from ``apply_chat_template(tokenize=True)``;
    both that and a plain id list are accepted.)
    """
    if not text or not text.strip():
        raise ConfigError("the prompt is empty: type some text first")
    if chat:
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
    else:
        out = tokenizer(text, add_special_tokens=False)
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], (list, tuple)):
        ids = list(ids[0])
    return [int(i) for i in ids]


def prompt_ids(info: TextInfo, settings: RunSettings, budget: int) -> tuple[list[int], str]:
    """The prompt's token ids as the run takes them and a note if they were cut (``fit_prompt``)."""
    ids = encode_prompt(info.tokenizer, settings.prompt, chat=settings.chat and info.supports_chat)
    return fit_prompt(ids, check_prompt(ids, info.context, settings.max_new_tokens, budget), settings.long_prompt)


@dataclass(frozen=True)
class Resolved:
    """The settings a run uses, why (``auto``'s reason, '' when nothing was ``auto``) and, where ``auto``
    priced exactly this run, its ``Prediction``."""

    settings: RunSettings
    note: str = ""
    prediction: Optional[Prediction] = None
    read_gb_per_s: Optional[float] = None  # the memory's read bandwidth probed for the plan (CPU runs)
    probed_at: float = 0.0  # (time.monotonic() of that probe)


#: a probe taken for the plan this recently also opens the run's read window (``RunRecord.read_window``)
PROBE_FRESH_S = 2.0


def resolve_auto(provider: ModelProvider, settings: RunSettings, planner: Any = None) -> Resolved:
    """``settings`` with every ``auto`` replaced by the provider's plan
    (``planner``: a ``ui.planner.BackgroundPlanner``: measure in the background, plan provisionally). On the CPU
    the memory's read bandwidth is probed first: the profile of its spell prices the plan."""
    if not settings.needs_auto:
        return Resolved(settings)
    if not settings.prompt or not settings.prompt.strip():
        raise ConfigError("the prompt is empty: type some text first")
    now = run_probe() if settings.device == "cpu" and not settings.offload else None
    probed_at = time.monotonic()
    plan = provider.auto_plan(settings, planner=planner, read_gb_per_s=now)
    resolved = replace(settings, **plan.resolve(settings.method, settings.precision, settings.draft_precision))
    predict = getattr(plan, "prediction", None)  # (a provisional plan has measured nothing to predict from)
    prediction = predict(settings.method, resolved.precision, resolved.draft_precision) if predict else None
    return Resolved(resolved, "; ".join(x for x in (plan.reason, _peers_note(settings, plan, prediction)) if x),
                    prediction, now, probed_at)


def _peers_note(settings: RunSettings, plan: Any, prediction: Optional[Prediction]) -> str:
    """Where the peers measured beside our plain decoding in Compare stand against this run's prediction ('' when
    nothing was measured or predicted)."""
    profile = getattr(plan, "profile", None)
    if prediction is None or profile is None:
        return ""
    prices = price_peers(load_peer_ratios(pair_name_of(settings.draft, settings.target), settings.device), profile)
    return peer_sentence(prices, prediction.s_per_token)


def remember_peer(plain: RunRecord | ExternalRun, peer: RunRecord | ExternalRun) -> None:
    """Keep a finished peer column's speed as a ratio to the finished plain-decoding column of the same Compare
    (``planning.peer_prices``): ``auto`` prices it from then on."""
    if not (isinstance(plain, RunRecord) and isinstance(peer, ExternalRun) and plain.status == "finished"
            and peer.status == "finished" and plain.config.method == "autoregressive"):
        return
    a, b = plain.summary(), peer.summary()  # (their tokens/s: what the two columns show)
    if not (a["tokens_per_s"] > 0 and b["tokens_per_s"] > 0):
        return
    record_peer_ratio(pair_name_of(plain.settings.draft, plain.settings.target), plain.settings.device,
                      f"{peer.label} @ {peer.precisions}", plain.config.precision, 1 / b["tokens_per_s"],
                      1 / a["tokens_per_s"], b["tokens"])


def _levels(n: int) -> str:
    return f"{n} level" if n == 1 else f"{n} levels"


def tree_note(form: RunSettings, cfg: DecodeConfig) -> str:
    """What the status line adds about the run's tree where the Budget and Depth fields do not
    describe it: a Sequoia tree (the drafter's own DP tree: with Method auto, or smaller than the
    budget), and that with Method auto the fields are not what sized the tree ('' otherwise).
    ``form``: the settings as the form gave them (``auto`` unresolved); ``cfg``: what runs."""
    parts = []
    if cfg.method == "sequoia":
        from dyntree_core.drafting.sequoia import SequoiaDrafter

        drafter = SequoiaDrafter(cfg)
        shape, acc = drafter.shape, drafter.acceptance
        levels = max(shape.depths())
        if form.method == AUTO or shape.size < cfg.budget or levels < cfg.depth:
            vector = ", ".join(f"{p:.2f}" for p in acc[:3]) + (", …" if len(acc) > 3 else "")
            source = "measured" if cfg.sequoia_acceptance is not None else "default (power-law)"
            parts.append(f"the run's tree: {shape.size} nodes, {_levels(levels)} below the root: Sequoia's DP picks "
                         f"the best tree of at most {cfg.budget} nodes and {_levels(cfg.depth)} for the {source} "
                         f"acceptance vector ({vector})"
                         + ("; more nodes add no expected tokens under it" if shape.size < cfg.budget else ""))
    if form.method == AUTO and cfg.method != "autoregressive":
        parts.append(f"with Method auto the tree is auto's choice for this machine, not the Budget and Depth "
                     f"fields ({form.budget}, {form.depth})")
    return "; ".join(parts)


def start_generation(provider: ModelProvider, settings: RunSettings,
                     stop_event: Optional[threading.Event] = None, planner: Any = None,
                     plain_probes: bool = False) -> Generation:
    """Validate ``settings``, load the pair (lazily, cached by the provider) and return a
    ``Generation`` that has not run any step yet; ``plain_probes``: a tree run times plain decoding inside
    itself where its steps allow (``decode.plain_probes``; ``RunRecord.plain_probed``).

    ``auto`` (method and/or precisions) is resolved first by the provider's measured cost model;
    the record's ``note`` carries the one-line reason. Raises ``ConfigError`` for invalid settings,
    ``ModelLoadError`` for an unloadable pair.
    """
    info = provider.text_info(settings.draft, settings.target)
    if info is not None:  # a prompt over the limit is refused before any planning or loading
        prompt_ids(info, settings, settings.budget)
    form = settings
    resolved = resolve_auto(provider, settings, planner)
    settings, note = resolved.settings, resolved.note
    cfg = settings.decode_config()
    pair = provider.load(settings.pair_spec())
    context = int(getattr(pair.target.config, "max_position_embeddings", 0) or 1 << 30)
    ids, cut = prompt_ids(TextInfo(pair.tokenizer, context, pair.supports_chat), settings, cfg.budget)
    decoder = SpeculativeDecoder.on_pair(pair.prepared(cfg), cfg, eos_token_id=list(pair.eos_token_ids) or None)
    decoder.plain_probes = plain_probes
    stop = stop_event or threading.Event()
    record = RunRecord(settings=settings, config=cfg, prompt_ids=list(ids), texts=TokenTexts(pair.tokenizer),
                       note="; ".join(n for n in (note, tree_note(form, cfg), cut) if n),
                       prediction=resolved.prediction, form=form, plain_probed=decoder.probes_plain())
    if resolved.prediction is not None and resolved.prediction.read_gb_per_s:
        fresh = resolved.read_gb_per_s and time.monotonic() - resolved.probed_at < PROBE_FRESH_S
        record.read_window = (resolved.read_gb_per_s if fresh else run_probe(), None)  # (before the run's clock)
    steps = decoder.generate(ids, settings.max_new_tokens, stop_event=stop, prefill_progress=True)
    return Generation(record, steps, stop)


def run_to_end(provider: ModelProvider, settings: RunSettings,
               stop_event: Optional[threading.Event] = None) -> RunRecord:
    """A whole generation (compare mode, AR baselines, tests)."""
    gen = start_generation(provider, settings, stop_event)
    gen.record.status = "running"
    while gen.advance() is not None:
        pass
    return gen.record


HF_ASSISTED_LABEL = "transformers assisted"


def run_hf_assisted(provider: ModelProvider, settings: RunSettings, stop_event: Optional[threading.Event] = None,
                    progress=None, planner: Any = None) -> ExternalRun:
    """transformers' own ``generate(..., assistant_model=draft)`` on the pair ``settings`` name (at
    the precisions they resolve to; ``auto`` is resolved as for a chain), same prompt, token budget,
    seed, temperature and top-p as our runs (``bench.hf_baselines.hf_generate``: the checkpoint's
    own sampling defaults are switched off, assistant settings are transformers' defaults).
    ``progress(tokens)`` is called after each round; ``stop_event`` ends it after the current round."""
    from dyntree_core.bench.hf_baselines import hf_assisted_defaults, hf_generate

    settings = resolve_auto(provider, settings.with_method("chain"), planner).settings
    settings.decode_config()
    pair = provider.load(settings.pair_spec())
    ids = encode_prompt(pair.tokenizer, settings.prompt, chat=settings.chat and pair.supports_chat)
    d = hf_assisted_defaults(pair.draft)
    run = hf_generate(pair.target, ids, int(settings.max_new_tokens), draft=pair.draft,
                      temperature=float(settings.temperature), top_p=float(settings.top_p), seed=int(settings.seed),
                      eos_token_id=list(pair.eos_token_ids) or None, stop_event=stop_event, on_put=progress)
    rounds, total = [], 0
    for i, (t, n) in enumerate(zip(run.put_seconds, run.put_tokens)):
        total += n
        rounds.append(RoundPoint(step=i, num_committed=n, elapsed=t, total_new_tokens=total))
    prec = f"target {settings.precision}, draft {settings.draft_precision}"
    note = (f"transformers {d['transformers']} assisted generation @ {prec}: up to {d['num_assistant_tokens']} "
            f"draft tokens per round ({d['num_assistant_tokens_schedule']}), draft stops below confidence "
            f"{d['assistant_confidence_threshold']}")
    return ExternalRun(label=HF_ASSISTED_LABEL, text=pair.tokenizer.decode(list(run.token_ids)),
                       token_ids=list(run.token_ids), rounds=rounds,
                       status="stopped" if run.stopped else "finished", note=note,
                       prompt=settings.prompt + ("\n" if settings.chat else ""), texts=TokenTexts(pair.tokenizer),
                       precisions=prec)
