"""Streaming anomaly detectors over node metrics, one per module (see :mod:`detectors.base`).

Importing this package is light: the torch autoencoder imports torch only when it first trains,
and scikit-learn is imported on the first Isolation Forest fit.
"""

from detectors.anomaly.autoencoder import Autoencoder
from detectors.anomaly.ewma import EWMAZScore
from detectors.anomaly.iforest import WindowedIsolationForest

__all__ = ["Autoencoder", "EWMAZScore", "WindowedIsolationForest"]
