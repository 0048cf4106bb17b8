"""Sharding: mesh construction and the logical-axis rules (the scale-out issue builds this).

Every parameter and cache leaf already declares its logical axes
(``specjax.models.param_logical_axes``, ``specjax.cache.cache_logical_axes``); the rules object that
maps them to mesh axes lives here once tensor/pipeline parallelism lands. Nothing is exported yet.
"""
