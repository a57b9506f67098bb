"""What ``auto`` is asked to choose: a request in which the method, the target precision and the
draft precision may each be ``"auto"``, turned into the precisions and methods to price
(``search_space``)."""

from __future__ import annotations

from .pricing import AUTO_METHODS

AUTO = "auto"  # the request value meaning "let the cost model choose"
#: the draft-model tree methods ``auto`` prices (their precisions stand in for methods it cannot price)
MODEL_TREE_METHODS: tuple[str, ...] = ("chain", "sequoia")


def default_precisions(device: str) -> tuple[str, ...]:
    return ("int8", "int4", "float32", "bfloat16") if device == "cpu" else ("float16", "bfloat16")


def search_space(method: str, precision: str, draft_precision: str,
                 device: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """``(target precisions, draft precisions, methods)`` that ``plan_auto`` prices for a request in
    which any of the three may be ``"auto"``. A fixed method that ``auto`` can price is priced
    against autoregressive decoding; one it cannot price (a DySpec or other tree method) gets the
    precisions ``auto`` would pick for the draft-model methods it can price."""
    tps = default_precisions(device) if precision == AUTO else (precision,)
    dps = default_precisions(device) if draft_precision == AUTO else (draft_precision,)
    if method == AUTO:
        methods: tuple[str, ...] = tuple(AUTO_METHODS)
    elif method in AUTO_METHODS:
        methods = tuple(dict.fromkeys(("autoregressive", method)))
    else:
        methods = ("autoregressive", *MODEL_TREE_METHODS)
    return tps, dps, methods
