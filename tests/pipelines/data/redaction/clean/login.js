// Login form handling: no secrets here, only names that sound like them.
import { hashPassword, verifyToken } from "./crypto.js";

export async function login(form) {
  const password = form.elements.password.value;
  const token = await fetchToken(form.elements.user.value, password);
  if (password.length < MIN_PASSWORD_LENGTH) {
    throw new Error("password too short");
  }
  const passwordHash = await hashPassword(password);
  localStorage.setItem("token", token);
  const apiKey = process.env.API_KEY;
  const secretKey = config.secretKey;
  return { token, passwordHash, apiKey, secretKey };
}

export const PASSWORD_FIELD = "password";
export const TOKEN_STORAGE_KEY = "session-token";
