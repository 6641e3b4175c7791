"""Warning categories of kfac's Python package, named as in kfac-pytorch's kfac.warnings."""

from __future__ import annotations


class ExperimentalFeatureWarning(Warning):
    """Raised through warnings.warn when a feature whose behaviour may still change is used."""
