"""Imported last by the ranks' fork server (``tests.dist._PRELOAD``): everything the server
imported moves to the collector's permanent generation, so that no rank forked from it walks
those objects again in a full collection, nor copies the pages it would write their headers
in.  The same as an application that calls ``gc.freeze()`` before it forks its workers (the
library's ``gcpause`` then leaves the freeze alone)."""

import gc

gc.collect()
gc.freeze()
