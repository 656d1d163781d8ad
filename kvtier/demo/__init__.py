"""The README's main job: a built-in agent session replayed without and with kvtier."""
