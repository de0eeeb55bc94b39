"""What l3plugin changes in and reads from the frameworks it plugs into, and the versions it checked them on.

``patchset.py`` declares patches of upstream objects (target, replacement, why, version range) and the private
upstream names read; ``patches.py`` is the registry of the modules that declare them; ``versions.py`` the
version ranges; ``doctor.py`` is ``l3plugin doctor``, which checks them all against what is imported.
Light on purpose: the autoload hook (l3plugin_autoload.py) imports from here at every interpreter start.
"""
