"""What the tests share: tiny models and tokenizers, scripted and oracle proposers, exact
distributions and goodness-of-fit, numpy references, kernel cases, a live server, rank workers."""
