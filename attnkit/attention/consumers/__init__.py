"""What is done with the results of the op, one consumer per module behind one protocol (`base.Consumer`):
extraction's features and the early stop (`features`), observers of q and k and of the max logit (`observers`),
head caches (`head_cache`), the training tracker (`tracker`)."""
from .base import BaseConsumer, Consumer, Result, Wants
from .features import EarlyStop, Features, FeaturesComplete, LayerFeatures
from .head_cache import HeadCaching
from .observers import MaxLogitObserver, QKObserver, observer_consumer
from .tracker import Tracking

__all__ = ["BaseConsumer", "Consumer", "EarlyStop", "Features", "FeaturesComplete", "HeadCaching", "LayerFeatures",
           "MaxLogitObserver", "QKObserver", "Result", "Tracking", "Wants", "observer_consumer"]
