"""Where an artifact's bytes live, below ``infer.artifact``: weight files on disk and their page-aligned layout
(``layout``), read-only mappings (``mapping``), per-file and per-chunk checksums (``checksums``), streaming
writers (``writer``) and the sources a streaming export reads tables from (``sources``)."""
