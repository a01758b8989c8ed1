"""The YAML recipes shipped with hf_tangent (`hf-tangent <command> --recipe <name>`); this folder is package data."""
