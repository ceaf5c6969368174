// placeholder until the actors land
