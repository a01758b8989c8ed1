"""The model card template shipped with hf_tangent; this folder is package data."""
