"""The torch-free wire formats every EPD process shares: item ids and storage keys, the
`ec_transfer_params` a producer returns and a consumer accepts, endpoints and the port
scheme, item descriptions, transport names. The gateway and the encoder pool import only
this layer (and transports); the connector's scheduler and worker roles import it too."""
