"""Drop-in replacements for other frameworks' metric helpers.

``rlmetrics.compat.verl`` provides ``verl.utils.metric``'s names (``Metric``,
``AggregationType``, ``reduce_metrics``, ``append_to_dict``) with optional weights and
conversion to rlmetrics states, for exact aggregation, and verl's ``MetricsAggregator``
(several iterations' metrics into one step) on rlmetrics states.
"""
