"""tandem's ground floor: what every other package shares, importing nothing else of tandem.

``errors`` (the one error taxonomy and its status table), ``protocol`` (the engine protocol,
its item types and routes, the replica-handle protocol), ``config`` (the configuration's types).
Packages import one way: tandem_core <- workers, diffusion_plugin <- gateway <- tandem_tools
(``tests/unit/test_layering.py`` keeps it so).
"""
