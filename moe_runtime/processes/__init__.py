"""The process layer: rank processes, the node launcher, torch.distributed set-up."""
