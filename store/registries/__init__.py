"""The registries (no torch): the build registry (prompt hash -> context id, build state;
embedded or in Redis) and the fleet's registry of facts in Redis, with its Lua scripts and the
build jobs' stream."""
