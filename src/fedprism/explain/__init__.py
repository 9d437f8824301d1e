"""Explanations of a model's predictions used by methods (Layer-wise Relevance Propagation: `lrp`)."""
