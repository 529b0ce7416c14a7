"""What a run leaves behind: checkpoints (save, restore, refuse a misfit)
and the exported SavedModel. Imports trainer.common and trainer.learning."""
