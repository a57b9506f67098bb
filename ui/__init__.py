"""DynTree's Gradio app: ``build_app(model_provider)`` plus the pure figure/text builders it uses.

Nothing here loads a model at import; providers load pairs lazily on the first Run. The package's
names are imported on first use, so its gradio-free modules (settings, cost view, tiny tokenizer)
import without gradio (the GPU machine has none).
"""

from importlib import import_module

_HOMES = {"AppDefaults": "app", "build_app": "app", "HubModelProvider": "models", "ModelProvider": "models",
          "PairSpec": "pair_spec"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(import_module(f".{_HOMES[name]}", __name__), name)
    if name in ("app", "models", "pair_spec"):
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
