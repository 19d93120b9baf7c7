"""Data-parallel attention: the control plane, lock-step agreement and cache-aware routing between DP workers."""
from moe_runtime.folder_names import yield_bare_name

yield_bare_name(__name__, __file__)   # first: this folder is imported as moe_runtime.attention_dp only
