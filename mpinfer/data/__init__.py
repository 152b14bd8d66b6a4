"""Data feeds for every stage (see :mod:`mpinfer.data.feeds`)."""

from mpinfer.data.feeds import ImagePreprocess, load_feeds, parse_dims, parse_input_ranges, random_batch
from mpinfer.data.source import FeedSource

__all__ = ["FeedSource", "ImagePreprocess", "load_feeds", "parse_dims", "parse_input_ranges", "random_batch"]
