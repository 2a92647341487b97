"""Text for calibration and evaluation, one concern per module: what a ``--data`` spec names and its documents
(:mod:`.specs`), checks before any model loads (:mod:`.checks`), tokenization and its cache (:mod:`.tokens`),
packed batches and held-out sequences (:mod:`.packing`), copy augmentation (:mod:`.augment`), the named corpora
(:mod:`.corpora`) and weighted mixtures (:mod:`.mixture`). Import from the module that defines a name; this
package re-exports nothing."""
