plugins {
    id("com.android.application") version "8.9.0" apply false
}
