"""Streaming anomaly detectors over node metrics, one per module (see :mod:`trainguard.detectors.base`).

Importing this package is light: the torch autoencoder imports torch only when it first trains,
and scikit-learn is imported on the first Isolation Forest fit.
"""

from trainguard.detectors.anomaly.autoencoder import Autoencoder
from trainguard.detectors.anomaly.ewma import EWMAZScore
from trainguard.detectors.anomaly.iforest import WindowedIsolationForest
from trainguard.detectors.anomaly.robust import RobustZScore

__all__ = ["Autoencoder", "EWMAZScore", "RobustZScore", "WindowedIsolationForest"]
