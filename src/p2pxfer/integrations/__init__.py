"""Serving engines reaching p2pxfer through their own plug-in APIs: the
shared pieces (``_bridge``: a daemon client in a thread for synchronous
callers; ``_tensors``: engines' per-layer KV tensors as blocks;
``_slots``: string request ids to small integers) and one package per
engine (``vllm``). Nothing here is imported by ``import p2pxfer``; an
engine's own package is imported only by that engine's plug-in loader.
"""
