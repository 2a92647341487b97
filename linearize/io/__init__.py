"""Models in and out: model specs and loading (:mod:`.sources`), checkpoint directories (:mod:`.checkpoint`) and
the rules for every folder linearize writes (:mod:`.outputs`)."""
