"""Dataset tools: text -> tokens -> packed windows -> MDS shards (+ metadata, verify).

Commands: `gpn-data …` or `gpn-scale data …`. Python API for the default corpus:
`data_tools.default_corpus.build_default_dataset`.
"""
