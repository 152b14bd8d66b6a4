"""Data feeds for every stage (see :mod:`mpinfer.data.feeds`)."""

from mpinfer.data.feeds import FeedSource, ImagePreprocess, load_feeds, parse_dims, parse_input_ranges, random_batch

__all__ = ["FeedSource", "ImagePreprocess", "load_feeds", "parse_dims", "parse_input_ranges", "random_batch"]
