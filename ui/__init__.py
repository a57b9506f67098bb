"""DynTree's Gradio app: ``build_app(model_provider)`` plus the pure figure/text builders it uses.

Nothing here loads a model at import; providers load pairs lazily on the first Run.
"""

from .app import AppDefaults, build_app
from .models import HubModelProvider, ModelProvider
from .pair_spec import PairSpec

__all__ = ["AppDefaults", "HubModelProvider", "ModelProvider", "PairSpec", "build_app"]
