"""Draft architectures: what speculators trains, what vLLM loads, what can go wrong between. One package each
(eagle3, dflash), each a `DraftArchitecture` (base.py), registered once in registry.py; nothing else in eaglet names
one. This file imports nothing, so an architecture's package can use base.py and checkpoint.py without a circle
through the registry."""
