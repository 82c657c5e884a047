"""Imported last by the ranks' fork server (``tests.dist._PRELOAD``): everything the server
imported moves to the collector's permanent generation, so that no rank forked from it walks
those objects again in a full collection, nor copies the pages it would write their headers
in.  The same as an application that calls ``gc.freeze()`` before it forks its workers: the
library's ``gcpause`` then leaves the freeze alone, so in the ranks it pauses the collector
without moving a pause's young records to the oldest generation; the tests of that move run in
the test process (``tests/test_resource_faults.py``)."""

import gc

gc.collect()
gc.freeze()
