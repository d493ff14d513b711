"""The step: the only torch part. The runner executes a scheduled batch through a family
(``diffusion_plugin.family``): the attention over KV pages, the experts' GEMMs, the vocabulary
pass, grammar masks and sampling filters."""
