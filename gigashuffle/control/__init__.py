"""The control plane: everything a loader keeps in Redis (who is here, what was agreed, what is alive).

Every key is built in ``keys``, every Lua script is a constant in ``lua``; nothing here touches the node buffer.
"""
