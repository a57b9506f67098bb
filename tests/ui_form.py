"""The run form's raw values by name, for the tests that drive ``ui.controller.Controller`` directly
(test_ui_controller.py)."""

from __future__ import annotations

import inspect

from ui.settings import settings_from_form


def form_values(**named) -> list:
    """The positional values ``settings_from_form`` (and so ``Controller.on_run``) takes, from their
    names; fields with a default may be left out, an unknown or a missing required name raises
    ``TypeError``."""
    bound = inspect.signature(settings_from_form).bind(**named)
    bound.apply_defaults()
    return list(bound.args)
