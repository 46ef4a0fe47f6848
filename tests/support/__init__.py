"""What the tests share and the product does not ship: engines driven by hand, servers, mocks.

Test modules import from here (and from conftest.py's fixtures), never from each other.
"""
