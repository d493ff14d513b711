"""The transport between gateway and replicas, in one place: both halves of the multiplexed
channel (``channel``: the actor's ``Outbox``, the gateway's ``Demux``) and the handles that use
it (``handles``: Ray and in-process)."""
